"""The stages import one way (README "How it works"): a stage never imports a later one, and the
runner, which ships without the compiler, never imports `aot` at all.

capture -> plan -> passes -> emit is the data's direction; the planner may run passes to price the
program as built (through the one compile path, aot/compile_step.py, which the build calls too), and
emit reads the plan's mesh. What must not happen is the reverse: capture
reaching into the planner or the passes, passes into the planner, anything in runner/ into aot/.
"""

from __future__ import annotations

import ast

import pytest

from helpers.commands import REPO

# importer package -> packages it must never import (at module level or inside a function)
FORBIDDEN = {
    "runner": ("aot",),
    # the runner's parts (runner/format/__init__.py): format <- hardware <- execution <- commands
    "runner.format": ("runner.hardware", "runner.execution", "runner.commands"),
    "runner.hardware": ("runner.execution", "runner.commands"),
    "runner.execution": ("runner.commands",),
    "aot.capture": ("aot.plan", "aot.passes", "aot.emit", "aot.build", "aot.cli", "aot.pipeline_build", "aot.compile_step", "aot.target"),
    "aot.passes": ("aot.plan", "aot.emit", "aot.build", "aot.cli", "aot.pipeline_build", "aot.compile_step", "aot.target"),
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
    """The axis names ("dp", "fsdp", "tp", "pp", "ep") are written once, in runner/format/axes.py: everything
    else asks it (issue #41), so a new axis lands there and where it is implemented. Docstrings and
    comments may name them; code may not."""
    names = {"dp", "fsdp", "tp", "pp", "ep"}
    found = []
    for package in ("aot", "runner"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "runner" / "format" / "axes.py":
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


# The compile path and its callers (issue #41): small enough to read in one sitting.
COMPILE_PATH = ("aot/build.py", "aot/compile_step.py", "aot/target.py", "aot/pipeline_build.py", "aot/plan/model_steps.py", "aot/plan/pipeline_programs.py")
MAX_FUNCTION_LINES = 100
MAX_PARAMETERS = 8  # self and cls not counted


def test_the_compile_path_has_no_long_function_or_signature():
    found = []
    for file in COMPILE_PATH:
        for node in ast.walk(ast.parse((REPO / file).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                params += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES or len(params) > MAX_PARAMETERS:
                    found.append(f"{file}:{node.lineno} {node.name}: {lines} lines, {len(params)} parameters")
    assert not found, "\n".join(found)


# Every private torch module or name aot and the runner use, and why no public API serves. A new
# use fails here until it is justified in this table (issue #41); a use removed must leave it.
# Ops (torch.ops.*, torch._foreach_*, torch._amp_*) are the operators graphs hold, not internals.
PRIVATE_TORCH = {
    "torch._ops": "OpOverload and OpOverloadPacket, the type of every FX node's target; torch has no public alias",
    "torch._library": "a custom op's definition (OPDEFS): whether it has a fake kernel and its schema; torch.library only registers",
    "torch.testing._internal": "the fake process group's backend registration (aot/capture/fake_group.py only)",
    "torch.nn.init._no_grad_trunc_normal_": "the sampler trunc_normal_ calls: redirected while model() is recorded, replayed as aot_init::trunc_normal_",
    "torch.compiler._is_compiling_flag": "what torch.compiler.is_compiling() reads: tracing takes torch.compile's path (tensor step counters)",
    "torch.distributed._functional_collectives": "the functional collectives (all_reduce, wait_tensor) torch documents live in this module",
    "torch._subclasses": "FakeTensorMode and FakeTensor: tracing on tensors that hold no memory",
    "torch._functorch": "the config make_fx patches while it makes its fake mode, which the planner makes the same way (training_state._made_fake)",
    "torch.utils._pytree": "tree_flatten, tree_map, tree_leaves: torch 2.13 has no public pytree module",
    "torch._guards": "detect_fake_mode: the fake mode a traced graph's values were made in",
    "torch._C": "process-group registration by name, dispatch-key guards, the AOTInductor loader and profiler event kinds",
    "torch._inductor": "aoti_compile_and_package and its C++ toolchain probe: AOTInductor's documented entry points",
    "torch._export": "the export schema's JSON serializer: torch.export.save writes a zip this format does not use",
    "torch.fx._lazy_graph_module": "graph modules without generated Python code (the planner reads graphs, never runs them)",
    "torch.cpu._is_avx2_supported": "the CPU's instruction sets, which a compiled (AOTInductor) program needs",
    "torch.cpu._is_avx512_supported": "the CPU's instruction sets, which a compiled (AOTInductor) program needs",
    "torch.cpu._is_vnni_supported": "the CPU's instruction sets, which a compiled (AOTInductor) program needs",
    "torch.cpu._is_amx_tile_supported": "the CPU's instruction sets, which a compiled (AOTInductor) program needs",
    "torch.utils._python_dispatch": "TorchDispatchMode: the runner's memory tracking sees every allocation",
    "torch.autograd.Variable._execution_engine": "queue_callback: a callback when a backward ends (DDP's hook); the planner's block annotation closes with it",
}


def _private_torch_names() -> dict[str, set[str]]:
    """private torch name (up to its first private part) -> the files using it."""

    def dotted(node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None

    def private(name: str) -> str | None:
        parts = name.split(".")
        if parts[0] != "torch" or parts[1:2] == ["ops"]:
            return None
        for i, part in enumerate(parts[1:], 1):
            if part.startswith("_") and not part.startswith("__"):
                return None if part.startswith(("_foreach_", "_amp_")) else ".".join(parts[: i + 1])
        return None

    found: dict[str, set[str]] = {}
    for package in ("aot", "runner"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Attribute):
                    names = [dotted(node) or ""]
                for name in names:
                    if (hit := private(name)) is not None:
                        found.setdefault(hit, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_private_torch_use_is_justified():
    found = _private_torch_names()
    unjustified = {name: sorted(files) for name, files in found.items() if name not in PRIVATE_TORCH}
    assert not unjustified, f"private torch used without a reason in PRIVATE_TORCH: {unjustified}"
    assert not set(PRIVATE_TORCH) - set(found), f"no longer used: {sorted(set(PRIVATE_TORCH) - set(found))}"
