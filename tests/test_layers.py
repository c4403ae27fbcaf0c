"""The stages import one way (README "How it works"): a stage never imports a later one, and the
runner, which ships without the compiler, never imports `aot` at all.

capture -> plan -> passes -> emit is the data's direction; the planner may run passes to price the
program as built, and emit reads the plan's mesh. What must not happen is the reverse: capture
reaching into the planner or the passes, passes into the planner, anything in runner/ into aot/.
"""

from __future__ import annotations

import ast

import pytest

from helpers.commands import REPO

# importer package -> packages it must never import (at module level or inside a function)
FORBIDDEN = {
    "runner": ("aot",),
    "aot.capture": ("aot.plan", "aot.passes", "aot.emit", "aot.build", "aot.cli", "aot.pipeline_build"),
    "aot.passes": ("aot.plan", "aot.emit", "aot.build", "aot.cli", "aot.pipeline_build"),
    "aot.plan": ("aot.emit", "aot.build", "aot.cli", "aot.pipeline_build"),
    "aot.emit": ("aot.build", "aot.cli", "aot.pipeline_build"),
}


def imports_of(package: str) -> list[tuple[str, int, str]]:
    """(file, line, imported module) for every absolute import in the package's files."""
    found = []
    for path in sorted((REPO / package.replace(".", "/")).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(REPO)), node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(REPO)), node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_stage_never_imports_a_later_one(package):
    found = imports_of(package)
    assert found, f"no imports found in {package}: the test reads the wrong folder"
    wrong = [f"{file}:{line} imports {module}" for file, line, module in found if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_round_a_cycle():
    """No import cycles between the project's modules, lazy (in-function) imports included: a lazy
    import hides a cycle from Python, not from the reader."""
    edges: dict[str, set[str]] = {}
    for package in ("aot", "runner"):
        for file, _, module in imports_of(package):
            name = file[:-3].replace("/", ".").removesuffix(".__init__")
            if module.split(".")[0] in ("aot", "runner") and module != name:
                edges.setdefault(name, set()).add(module)
    # a package's __init__ re-exporting its modules is not a cycle with them
    edges = {a: {b for b in bs if not a.startswith(b + ".")} for a, bs in edges.items()}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_private_torch_modules_are_used_where_a_comment_says_why():
    """torch's private modules are torch's to change: each use in aot/ and runner/ is in the one
    module that owns it, whose docstring says why no public API serves. Today: the fake process
    group's backend registration (aot/capture/fake_group.py)."""
    allowed = {"torch.testing._internal.distributed.fake_pg": {"aot/capture/fake_group.py"}}
    found = {}
    for package in ("aot", "runner"):
        for file, _, module in imports_of(package):
            if module.startswith("torch.testing"):
                found.setdefault(module, set()).add(file)
    assert found == allowed, found


def test_only_runner_axes_names_the_mesh_axes():
    """The axis names ("dp", "fsdp", "tp", "pp") are written once, in runner/axes.py: everything
    else asks it (issue #41), so a new axis lands there and where it is implemented. Docstrings and
    comments may name them; code may not."""
    names = {"dp", "fsdp", "tp", "pp"}
    found = []
    for package in ("aot", "runner"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "runner" / "axes.py":
                continue
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in ast.walk(tree):
                literal = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                if literal and (node.value in names or node.value.removeprefix("aot.") in names):  # an axis, or its group
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not found, "\n".join(found)
