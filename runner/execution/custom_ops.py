"""Custom operators: the op libraries an artifact's program needs, imported before it is decoded.

A program names custom operators (`torch.library.custom_op`) by their qualified name
(`namespace::name`); torch resolves those names only once the Python module that registers them
has been imported. The manifest's optional `custom_ops` entry lists both: `ops` (what the program
uses) and `modules` (what registers them). The runner imports those modules by name, never the
model file, so they must be importable on every node (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import importlib

import torch

from runner.errors import AotError


def op_is_registered(qualname: str) -> bool:
    namespace, _, name = qualname.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def import_op_libraries(manifest: dict) -> list[str]:
    """Import the modules of the manifest's `custom_ops` entry and check that every op it lists is
    registered afterwards; returns the modules imported. AotError (one line) on any failure."""
    spec = manifest.get("custom_ops")
    if spec is None:
        return []
    modules, ops = (spec.get(k) if isinstance(spec, dict) else None for k in ("modules", "ops"))
    if not (isinstance(modules, list) and isinstance(ops, list) and all(isinstance(x, str) for x in modules + ops)):
        raise AotError("manifest.json: custom_ops needs modules and ops (lists of names)")
    uses = f"the program uses custom operator{'s' if len(ops) != 1 else ''} {', '.join(ops) or '(none)'}"
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise AotError(f"{uses}, registered by module {name!r}, which cannot be imported here ({e}); install it or add its folder to PYTHONPATH") from None
        except Exception as e:
            raise AotError(f"importing custom operator module {name!r} raised {type(e).__name__}: {e}") from e
    for op in ops:
        if not op_is_registered(op):
            raise AotError(
                f"custom operator {op} is not registered after importing {', '.join(modules) or 'nothing'}; "
                f"the op library on this node differs from the one the artifact was built with"
            )
    return modules
