"""aot: ahead-of-time compile-and-package toolchain for distributed PyTorch training.

Stages, one folder each: capture (model.py -> one FX graph of the whole step), plan (mesh and
strategy), passes (graph-to-graph optimizations), emit (the artifact, written through `runner`).
"""

__version__ = "0.1.0"
