"""The aot runtime: loads a built artifact and trains from it, with no model code.

`runner.load(path, rank=...)` returns a `Trainer`; `python -m runner run ...` (or `aot run`) is the
command line. This package never imports `aot`: a production node needs only what it needs.
"""

__version__ = "0.1.0"


def load(path, rank=None, **kwargs):
    """Load one rank of an artifact; see `runner.execution.trainer.Trainer`."""
    from runner.execution.trainer import Trainer

    return Trainer(path, rank, **kwargs)


__all__ = ["load", "__version__"]
