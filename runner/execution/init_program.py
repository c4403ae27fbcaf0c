"""Replaying an artifact's init program: each rank creates its own piece of the initial weights.

An artifact (format 3) ships no weights. `aot build` recorded what `torch.manual_seed(seed);
model()` does to create each parameter and buffer (factory ops and in-place initializers:
`empty`, `normal_`, `uniform_`, `fill_`, ...) as a program in the same pickle-free encoding as
the training programs. Replayed on the CPU after the same seed it gives tensors bit-identical to
eager construction (CPU, since eager construction draws from the CPU's generator).

Every rank replays every op, so the random draws happen in the same order on all of them, but it
keeps only its own piece of each parameter (`keep`: its tensor-parallel slice, its fsdp shard).
Peak memory stays near that piece plus the largest single parameter, because a tensor's memory is
released as soon as its values are dead:
- after the last op that touches it, the rank's piece is cut and the whole tensor dropped;
- between an op and a later op that overwrites all of it, its storage is shrunk to nothing and
  re-grown just before the overwrite. nanoGPT's and Hugging Face's `_init_weights` re-initialize
  every weight after the whole model is built; without this, every weight would be alive at once.
  The overwritten values are never read, so the result is the same, and the draws still happen.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree

from runner.execution.data import dtype_of
from runner.errors import AotError
from runner.execution import init_ops
from runner.execution.graph_loader import load_graph_module
from runner.format.program import decode_program
from runner.format.sharding import axis_index, expert_slice, shard, tp_fused, tp_slice

_aten = torch.ops.aten
# In-place ops that write every element of their first argument without reading it.
_OVERWRITES = {
    _aten.normal_.default,
    _aten.uniform_.default,
    _aten.fill_.Scalar,
    _aten.fill_.Tensor,
    _aten.zero_.default,
    _aten.random_.default,
    getattr(_aten.random_, "from"),
    _aten.random_.to,
    _aten.exponential_.default,
    _aten.bernoulli_.float,
    _aten.log_normal_.default,
    _aten.cauchy_.default,
    _aten.geometric_.default,
    _aten.copy_.default,
    init_ops.trunc_normal_,
}
# Ops that draw random numbers: a partial replay must not skip any of them.
_RANDOM = {op for op in _OVERWRITES if op not in (_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default, _aten.copy_.default)}
# Views that cover every element of their input: an overwrite through one of them writes it all.
_WHOLE_VIEWS = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.default,
    _aten.flatten.using_ints,
}


def load_init_graph(program_json: bytes, constants: bytes | None) -> torch.fx.GraphModule:
    """The init program as a GraphModule on the CPU (no inputs; outputs: params, then buffers)."""
    module = load_graph_module(program_json, torch.device("cpu"), constants)
    return module if module is not None else decode_program(program_json, constants).module()


def _aliases_first_input(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None and node.args and isinstance(node.args[0], torch.fx.Node))


def _writes_first_input(node: torch.fx.Node) -> bool:
    """An in-place op (`normal_`, `mul_`): it returns its first input itself, every element of it."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None and schema.returns[0].alias_info.is_write)


@dataclass
class _Plan:
    """When each tensor's storage (its root: the node that allocated it) is touched, overwritten and done."""

    root: dict  # node -> the node whose result owns its storage
    last_touch: dict  # root -> index of the last node that reads, writes or views it
    overwritten_at: set  # (root, index): the node at index overwrites all of root
    next_touch: dict  # (root, index) -> index of the next touch of root after index, if any
    members: dict  # root -> nodes whose result is a view of it
    outputs: list  # output nodes, in output order


def _plan(graph: torch.fx.Graph) -> _Plan:
    nodes = list(graph.nodes)
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    whole: dict[torch.fx.Node, bool] = {}  # node -> its result covers all of its root's storage
    touches: dict[torch.fx.Node, list[int]] = {}
    members: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op == "call_function" and (_aliases_first_input(node) or node.target is operator.getitem):
            root[node] = root[node.args[0]]
            whole[node] = whole[node.args[0]] and (node.target in _WHOLE_VIEWS or _writes_first_input(node))
        else:
            root[node], whole[node] = node, True
        members.setdefault(root[node], []).append(node)
        for r in {root[node], *(root[n] for n in node.all_input_nodes)}:
            touches.setdefault(r, []).append(i)
    overwritten = {
        (root[node.args[0]], i)
        for i, node in enumerate(nodes)
        if node.op == "call_function"
        and node.target in _OVERWRITES
        and isinstance(node.args[0], torch.fx.Node)
        and whole[node.args[0]]
        and node.args[0] not in node.args[1:]
    }
    next_touch = {(r, a): b for r, idx in touches.items() for a, b in zip(idx, idx[1:])}
    output = next(n for n in nodes if n.op == "output")
    return _Plan(root, {r: idx[-1] for r, idx in touches.items()}, overwritten, next_touch, members, pytree.tree_leaves(output.args))


def _needed(graph: torch.fx.Graph, plan: _Plan, wanted: set) -> set | None:
    """The nodes `wanted` outputs depend on (every node touching a storage they read), or None if
    that takes a random op: then only a full replay draws the right numbers."""
    by_root: dict = {}
    for node in plan.root:
        for r in {plan.root[node], *(plan.root[n] for n in node.all_input_nodes)}:
            by_root.setdefault(r, []).append(node)
    needed, stack = set(), [plan.root[n] for n in wanted]
    seen_roots = set()
    while stack:
        r = stack.pop()
        if r in seen_roots:
            continue
        seen_roots.add(r)
        for node in by_root.get(r, []):
            if node.op == "call_function" and node.target in _RANDOM:
                return None
            needed.add(node)
            stack.extend(plan.root[n] for n in node.all_input_nodes)
    return needed


def replay(
    gm: torch.fx.GraphModule,
    names: list[str],
    seed: int,
    keep: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t,
    only: set[str] | None = None,
    peak: list | None = None,
) -> dict[str, torch.Tensor]:
    """Run the init program after `torch.manual_seed(seed)` (the caller's RNG state is left as it
    was) and return `keep(name, tensor)` for each output, named by `names` in output order;
    `only`: just those outputs (a random op among what they need replays everything). `peak`, if
    given, gets the most bytes of tensor storage held at once (what the tests check)."""
    graph = gm.graph
    plan = _plan(graph)
    if len(plan.outputs) != len(names):
        raise AotError(f"the init program makes {len(plan.outputs)} tensors, the manifest names {len(names)}")
    name_of: dict[torch.fx.Node, list[str]] = {}
    for name, node in zip(names, plan.outputs):
        name_of.setdefault(node, []).append(name)
    wanted = {n for n in plan.outputs if only is None or set(name_of[n]) & only}
    needed = _needed(graph, plan, wanted) if only is not None else None
    done_roots = {plan.root[n] for n in wanted}
    env: dict = {}
    parked: dict = {}  # root -> bytes its storage had before it was released
    result: dict[str, torch.Tensor] = {}

    def storage(r):
        return env[r].untyped_storage()

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for i, node in enumerate(graph.nodes):
            if node.op == "output":
                break
            if needed is not None and node not in needed:
                continue
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            elif node.op == "call_function":
                r = plan.root[node]
                if (r, i) in plan.overwritten_at and r in parked:
                    storage(r).resize_(parked.pop(r))
                args, kwargs = pytree.tree_map_only(torch.fx.Node, env.__getitem__, (node.args, node.kwargs))
                env[node] = node.target(*args, **kwargs)
            else:
                raise AotError(f"the init program has a {node.op} node; it takes no inputs")
            for r in {plan.root[node], *(plan.root[n] for n in node.all_input_nodes)}:
                if plan.last_touch[r] == i:
                    if r in done_roots:
                        for member in plan.members[r]:
                            for name in name_of.get(member, ()) if member in wanted else ():
                                result[name] = keep(name, env[member])
                    for member in plan.members[r]:
                        env.pop(member, None)
                elif (r, plan.next_touch[(r, i)]) in plan.overwritten_at and r in env:
                    parked[r] = storage(r).nbytes()
                    storage(r).resize_(0)
            if peak is not None:
                peak.append(max(peak.pop() if peak else 0, _held_bytes([*env.values(), *result.values()])))
    return result


def _held_bytes(values) -> int:
    storages = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in values if isinstance(v, torch.Tensor)}
    return sum(storages.values())


def piece_keeper(manifest: dict, coords: dict[str, int]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """keep(name, tensor) for `replay`: the piece of each parameter a rank with `coords` holds (its
    tensor-parallel slice, then its fsdp shard of that; artifacts/FORMAT.md), buffers whole."""
    tp, sharding = manifest.get("tensor_parallel") or {}, manifest.get("sharding") or {}
    ep = manifest.get("expert_parallel") or {}
    params, experts = manifest["state"]["params"], set(ep.get("params", []))
    tp_index, ep_index = axis_index(coords, tp), axis_index(coords, ep)

    def keep(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in params:
            return t
        piece = tp_slice(t, tp.get("params", {}).get(name), tp.get("size", 1), tp_index, tp_fused(tp, name))
        if name in experts:
            piece = expert_slice(piece, ep["size"], ep_index)
        if name in sharding.get("params", {}):
            piece = shard(piece, sharding["size"], coords[sharding["axis"]])
        return piece

    return keep


def stage_tensors(manifest: dict, coords: dict[str, int]) -> set[str] | None:
    """The parameters and buffers a pipeline rank's stages hold (manifest `pipeline.stages`), or
    None without a pipeline (every rank holds every one, or its piece)."""
    pipeline = manifest.get("pipeline")
    if not pipeline:
        return None
    rank = coords.get(pipeline["axis"], 0)
    return {n for s in pipeline["stages"] if s["rank"] == rank for n in (*s["params"], *s["buffers"])}


def initial_optimizer_state(optimizer_init: dict[str, dict], weights: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The optimizer's initial state from the manifest's description (`state.optimizer_init`):
    each tensor filled with one value, shaped like its parameter's piece on this rank or as given.
    Filled where it is used (`device`; 0-dim state, step counters, stays on the CPU as torch.optim
    keeps it): Adam's moments are twice the model's weights, seconds of a cold start to fill on
    the host and copy over."""
    out = {}
    for key, spec in optimizer_init.items():
        name = key.rpartition(":")[0]
        dtype = dtype_of(spec["dtype"])
        shape = weights[name].shape if spec["shape"] == "param" else spec["shape"]
        where = device if device is not None and len(shape) > 0 else None
        out[key] = torch.full(shape, spec["fill"], dtype=dtype, device=where)
    return out


# Loss-scaling state is kept with the optimizer state under "grad_scaler:<key>" (runner.format.artifact.
# SCALER_KEYS), so checkpoints carry it.
SCALER_PREFIX = "grad_scaler:"


def initial_scaler_state(grad_scaler: dict) -> dict[str, torch.Tensor]:
    """torch.amp.GradScaler's state before the first step (the scale and growth tracker as
    1-element tensors, as it keeps them), plus the count of steps skipped on overflow."""
    return {
        "scale": torch.full((1,), float(grad_scaler["init_scale"]), dtype=torch.float32),
        "growth_tracker": torch.zeros(1, dtype=torch.int32),
        "skipped_steps": torch.zeros(1, dtype=torch.int64),
    }


def initial_state(
    artifact, coords: dict[str, int], init_from=None, device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, optimizer state) of the rank with `coords` before its first step, on the CPU:
    its pieces of the init program's tensors, or of the user's weights (`init_from`, a checked
    runner.execution.init_from.InitFrom) with the buffers no state_dict holds from the program; and the
    optimizer state `state.optimizer_init` describes, made on `device` where given (weights are
    always made on the CPU, where the init program replays eager's random draws)."""
    from runner.execution.init_from import rank_weights

    manifest = artifact.manifest
    init, spec = manifest["init"], manifest["state"]
    graph = load_init_graph(artifact.read(init["file"]), artifact.read(init["constants"]) if init.get("constants") else None)
    keep = piece_keeper(manifest, coords)
    seed = int(manifest["build"].get("seed", 0))
    # A pipeline rank holds its stages' parameters and buffers only: the replay still draws every
    # random number in order (other stages' draws move the generator), but keeps none of the other
    # stages' tensors past their last use, so a rank's memory at start-up is its stages', not the model's.
    held = stage_tensors(manifest, coords)
    if init_from is None:
        weights = replay(graph, init["outputs"], seed, keep, only=held)
    else:
        weights = rank_weights(init_from, coords, only=held)
        constants = set(spec["buffers"]) - set(spec["persistent_buffers"])
        constants &= held if held is not None else constants
        weights.update(replay(graph, init["outputs"], seed, keep, only=constants) if constants else {})
    optimizer = initial_optimizer_state({k: v for k, v in spec["optimizer_init"].items() if k.rpartition(":")[0] in weights}, weights, device)
    scaler = (artifact.manifest.get("precision") or {}).get("grad_scaler")
    if scaler is not None:
        optimizer.update({SCALER_PREFIX + k: v for k, v in initial_scaler_state(scaler).items()})
    return weights, optimizer
