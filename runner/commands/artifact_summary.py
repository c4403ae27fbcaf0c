"""`aot inspect`: what an artifact holds, read from its manifest alone (nothing is deserialized);
the one-line descriptions it shares with `aot build` are runner/commands/formatting.py's."""

from __future__ import annotations

import math
from collections import Counter

from runner.format.artifact import Artifact
from runner.commands.formatting import describe_batchnorm, describe_replicas, describe_time, human, rank_ranges, replica_lines, tp_layer
from runner.format.sharding import shard_number, shard_numel, tp_slice_shape


def describe_capacity(capacity) -> str:
    """A manifest's `expert_parallel.capacity` in words."""
    return "the model's own (its blocks fill their dispatch buffers)" if capacity == "model" else str(capacity)


def _bytes(shape_dtype: list) -> int:
    import torch

    shape, dtype = shape_dtype
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _optimizer_bytes(m: dict, rank: dict, held: dict[str, int]) -> int:
    """The optimizer state one rank holds, as `state.optimizer_init` describes it ("param"-shaped
    state is as big as the rank's piece of its parameter)."""
    total = 0
    for key, spec in m["state"]["optimizer_init"].items():
        if key.rpartition(":")[0] not in held:  # another pipeline stage's
            continue
        numel = held[key.rpartition(":")[0]] if spec["shape"] == "param" else math.prod(spec["shape"])
        total += _bytes([[numel], spec["dtype"]])
    return total


def describe_pipeline(p: dict | None) -> list[str]:
    """The manifest's `pipeline`: the schedule, and each stage's rank, layers and parameters."""
    if not p:
        return []
    lines = [
        f"pipeline   pp={p['size']} {p['schedule']}, {p['microbatches']} microbatches of {p['microbatch_size']}"
        + (f", {p['stages_per_rank']} stages per rank" if p["stages_per_rank"] > 1 else "")
        + f" over {p['group']}; predicted bubble {p['predicted_bubble']:.0%} of the step"
    ]
    for s in p["stages"]:
        layers = s["layers"][0] if len(s["layers"]) == 1 else f"{s['layers'][0]} .. {s['layers'][-1]} ({len(s['layers'])} layers)"
        lines.append(f"  stage {s['stage']}  pipeline rank {s['rank']} ({s['program']}): {layers}, {len(s['params'])} parameter tensors")
    if p.get("tied"):
        lines.append(f"  tied across stages, gradients summed over {p['group']}: {', '.join(p['tied'])}")
    return lines


def describe_precision(p: dict) -> str:
    """One line: the compute dtype, whose autocast rules, and the dtypes of the collectives."""
    if p["compute"] == "fp32":
        return "fp32 throughout"
    scaler = p.get("grad_scaler")
    return (
        f"{p['compute']} autocast ({p.get('autocast_rules')}'s rules), fp32 master weights and optimizer state, "
        f"fsdp gathers in {p['param_dtype']}, gradients reduced in {p['reduce_dtype']}"
        + (
            f"; dynamic loss scaling from {scaler['init_scale']:g} (x{scaler['growth_factor']:g} every "
            f"{scaler['growth_interval']} clean steps, x{scaler['backoff_factor']:g} on overflow)"
            if scaler
            else ""
        )
    )


def held_experts(expert_parallel: dict, coords: dict[str, int]) -> dict[str, list[int]]:
    """module -> [first, stop) of the experts an ep rank at `coords` holds (artifacts/FORMAT.md,
    "Expert-parallel layout": ep rank i holds the i-th of `size` equal runs of every module's experts)."""
    size, index = expert_parallel["size"], coords.get(expert_parallel["axis"], 0)
    return {module: [index * count // size, (index + 1) * count // size] for module, count in expert_parallel["experts"].items()}


def describe_experts(summary: dict) -> list[str]:
    """`aot inspect`'s expert-parallel lines: the layers split, and which experts each ep rank holds."""
    ep = summary.get("expert_parallel")
    if not ep:
        return []
    counts = sorted(set(ep["experts"].values()))
    lines = [
        f"expert parallel over {ep['size']} ranks ({ep['group']}): {len(ep['experts'])} experts layer(s) of "
        f"{'/'.join(map(str, counts))} experts, tokens dispatched by all_to_all, capacity {describe_capacity(ep['capacity'])}"
    ]
    for index in range(ep["size"]):
        runs = sorted({tuple(v) for v in held_experts(ep, {ep["axis"]: index}).values()})
        ranks = [r["rank"] for r in summary["ranks"] if r["coords"].get(ep["axis"], 0) == index]
        held = ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in runs)
        lines.append(f"  ep={index}  experts {held} of every layer  (ranks {rank_ranges(ranks)})")
    return lines


def summarize(artifact: Artifact) -> dict:
    m = artifact.manifest
    state = m["state"]
    # Per rank: a tensor-parallel parameter counts with its slice, and an fsdp-sharded one with
    # its shard of that, flat-padded to a multiple of N.
    sharding, tp, ep = m.get("sharding") or {}, m.get("tensor_parallel") or {}, m.get("expert_parallel") or {}
    parts = sharding.get("size", 1)
    held = {}
    for n, (s, _) in state["params"].items():
        numel = math.prod(tp_slice_shape(s, tp.get("params", {}).get(n), tp.get("size", 1)))
        numel //= ep["size"] if n in ep.get("params", []) else 1
        held[n] = shard_numel(numel, parts) if n in sharding.get("params", {}) else numel
    dtypes = {n: dtype for n, (_, dtype) in state["params"].items()}
    pipeline = m.get("pipeline")

    def rank_held(coords: dict) -> dict[str, int]:  # a pipeline rank holds its stages' parameters
        if not pipeline:
            return held
        mine = {n for s in pipeline["stages"] if s["rank"] == coords.get(pipeline["axis"], 0) for n in s["params"]}
        return {n: k for n, k in held.items() if n in mine}

    programs = {}
    for name, program in m["programs"].items():
        collectives = program["collectives"]
        programs[name] = {
            # the ranks that run it: as their training program, or as their eval program
            "ranks": [r["rank"] for r in m["ranks"] if name in (r["program"], r.get("eval_program"))],
            "graph_nodes": program.get("graph_nodes"),
            "collectives_per_step": len(collectives),
            "collective_bytes_per_step": sum(c["bytes"] for c in collectives),
            "collectives": collectives,
        }
    ranks = []
    for r in m["ranks"]:
        mine = rank_held(r["coords"])
        param_bytes = sum(_bytes([[k], dtypes[n]]) for n, k in mine.items())
        ranks.append(
            {
                "rank": r["rank"],
                "program": r["program"],
                "coords": r["coords"],
                "parameters": sum(mine.values()),
                "parameter_bytes": param_bytes,
                # parameters + their gradients + the optimizer state this rank holds
                "training_state_bytes": 2 * param_bytes + _optimizer_bytes(m, r, mine),
                # expert parallelism: the experts this rank holds of each experts module, [first, stop)
                **({"experts": held_experts(ep, r["coords"])} if ep else {}),
                "state_shard": shard_number(
                    r["coords"],
                    m.get("sharding"),
                    m.get("tensor_parallel"),
                    {"axis": pipeline["axis"], "size": pipeline["size"]} if pipeline else None,
                    m.get("expert_parallel"),
                ),
            }
        )
    return {
        "path": str(artifact.root),
        "format_version": m["format_version"],
        "torch_version": m["torch_version"],
        "aot_version": m.get("aot_version"),
        "build": m.get("build", {}),
        "topology": {"name": m["topology"]["name"], "sha256": m["topology"]["sha256"]},
        "world_size": m["world_size"],
        "mesh": m["mesh"],
        "placement": m.get("placement"),
        "optimizer": state["optimizer"]["class"],
        "precision": m.get("precision") or {"compute": "fp32", "param_dtype": "fp32", "reduce_dtype": "fp32"},
        "programs": programs,
        "ranks": ranks,
        "files": m["files"],
        "inference": m.get("inference"),
        "custom_ops": m.get("custom_ops"),
        "compiled": m.get("compiled"),
        "plan": m.get("plan"),
        "memory": m.get("memory"),
        "time": m.get("time"),
        "tensor_parallel": m.get("tensor_parallel"),
        "expert_parallel": m.get("expert_parallel"),
        "batchnorm": m.get("batchnorm"),
        "replicas": m.get("replicas"),
        "pipeline": pipeline,
        "init": m.get("init"),
        "total_bytes": sum(f["size"] for f in m["files"].values()),
    }


def predicted_time(summary: dict) -> dict:
    """The build's predicted step (`time.predicted`, every build since it existed; else a
    `--strategy auto` plan's `predicted`)."""
    return (summary.get("time") or {}).get("predicted") or (summary.get("plan") or {}).get("predicted") or {}


def compare_profile(summary: dict, measured: dict) -> dict:
    """Measured times (runner.execution.profiling) next to the build's prediction, where it has one."""
    predicted = predicted_time(summary)
    rows = {}
    for key in ("step_s", "compute_s", "exposed_comm_s"):
        m, p = measured.get(key), predicted.get(key)
        rows[key] = {"measured": m, "predicted": p, "ratio": (m / p) if (m is not None and p) else None}
    return {
        "steps_profiled": measured.get("steps_profiled"),
        "tier": measured.get("tier"),
        "trace": measured.get("trace"),
        "times": rows,
        "memory": compare_memory(summary, measured.get("memory")),
    }


def predicted_memory(summary: dict) -> tuple[dict | None, str | None]:
    """The build's memory prediction for one rank ({"peak", "resident", "at_peak"}, bytes) and where
    it came from: the manifest's `memory.predicted` (every build), else a `--strategy auto`
    plan's `predicted.memory_bytes` (artifacts built before the first existed)."""
    memory = summary.get("memory")
    predicted = memory.get("predicted") if isinstance(memory, dict) else None
    if isinstance(predicted, dict) and isinstance(predicted.get("peak"), (int, float)):
        return predicted, "memory.predicted"
    plan = (summary.get("plan") or {}).get("predicted") or {}
    mem = plan.get("memory_bytes")
    if isinstance(mem, dict) and isinstance(mem.get("peak"), (int, float)):
        resident = {k: mem[k] for k in ("params", "buffers", "optimizer", "batch") if k in mem}
        return {"peak": mem["peak"], "resident": resident, "at_peak": mem.get("at_peak") or {}}, "plan.predicted.memory_bytes"
    return None, None


def compare_memory(summary: dict, measured: dict | None) -> dict | None:
    """Each rank's measured peak (profile.json's "memory") next to the predicted peak per rank;
    None for profiles written before memory was measured."""
    if not isinstance(measured, dict):
        return None
    peaks = measured.get("measured_peak_bytes")
    peaks = peaks if isinstance(peaks, list) and peaks and all(isinstance(p, int) for p in peaks) else None
    predicted, source = predicted_memory(summary)
    peak = predicted["peak"] if predicted else None
    return {
        "method": measured.get("method"),
        "step": measured.get("step"),
        "measured_peak_bytes": peaks,
        "measured_max_bytes": max(peaks) if peaks else None,
        "predicted_peak_bytes": peak,
        "predicted": predicted,
        "predicted_from": source,
        "ratio": max(peaks) / peak if (peaks and peak) else None,
        "ratio_per_rank": [p / peak for p in peaks] if (peaks and peak) else None,
    }


# the prediction's parts in the order they are listed (others follow, by name)
_MEMORY_PARTS = ("params", "buffers", "optimizer", "batch", "activations", "gradients", "collective_buffers", "updated_state")


def describe_memory(memory: dict | None) -> list[str]:
    """The manifest's `memory`: the predicted peak per rank, itemized, and what the build recomputes."""
    if not memory:
        return ["memory     no prediction (built before aot predicted memory)"]
    p, rc = memory["predicted"], memory.get("recompute") or {}
    resident, at_peak = p["resident"], p["at_peak"]
    lines = [
        f"memory     predicted peak {human(p['peak'])} per rank: parameters {human(resident.get('params', 0))}, "
        f"buffers {human(resident.get('buffers', 0))}, optimizer state {human(resident.get('optimizer', 0))}, "
        f"batch {human(resident.get('batch', 0))}; at the peak " + ", ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in at_peak.items())
    ]
    policy = rc.get("policy", "none")
    if policy == "stages":  # a pipeline's: each stage's forward again in its backward
        before = f"; predicted peak {human(rc['peak_without_recompute'])} without" if "peak_without_recompute" in rc else ""
        lines.append(f"  recompute  every stage's forward again in its backward (asked by {rc.get('source')}{before})")
        return lines
    if policy == "none" or not rc.get("recomputed_values"):
        lines.append(f"  recompute  nothing ({'the step fits ' + human(rc['memory_budget_bytes']) if 'memory_budget_bytes' in rc else 'no budget given'})")
        return lines
    asked = {
        "modules": lambda: f"model file: checkpoint {', '.join(rc.get('modules', []))}" + (", matmul outputs kept" if rc.get("save") == "matmuls" else ""),
        "checkpoint_calls": lambda: "the model's torch.utils.checkpoint calls",
        "budget": lambda: f"{rc.get('source')} " + (human(rc["memory_budget_bytes"]) if "memory_budget_bytes" in rc else f"{rc.get('activation_budget')}"),
    }[policy]()
    lines.append(
        f"  recompute  {rc.get('recomputed_values')} saved value(s) rebuilt in backward ({rc.get('recomputed_ops')} ops, "
        f"predicted {rc.get('predicted_recompute_s', 0) * 1e3:.3g} ms per step): saved activations "
        f"{human(rc.get('saved_activation_bytes', 0))} -> {human(rc.get('kept_activation_bytes', 0))}; asked by {asked}"
    )
    return lines


def _memory_lines(memory: dict | None) -> list[str]:
    if not memory:
        return []
    peaks = memory["measured_peak_bytes"]
    if peaks is None:
        lines = [f"  {'peak memory':<22} {memory['method']}"]
    else:
        per_rank = "" if len(set(peaks)) == 1 else " (max over ranks; " + ", ".join(f"rank {r} {human(p)}" for r, p in enumerate(peaks)) + ")"
        lines = [f"  {'peak memory':<22} measured {human(max(peaks))} per rank{per_rank} in step {memory['step']}, {memory['method']}"]
    predicted = memory.get("predicted")
    if not predicted:
        lines.append(f"  {'':<22} no prediction in this artifact (built before aot predicted memory)")
        return lines
    ratio = f", measured/predicted {memory['ratio']:.3f}" if memory.get("ratio") is not None else ""
    parts = []
    for name, label in (("resident", "resident:"), ("at_peak", "at the peak:")):
        part = predicted.get(name) if isinstance(predicted.get(name), dict) else {}
        known = [k for k in _MEMORY_PARTS if k in part] + sorted(k for k in part if k not in _MEMORY_PARTS)
        shown = [f"{k} {human(part[k])}" for k in known if isinstance(part[k], (int, float)) and part[k]]
        if shown:
            parts.append(f"{label} {', '.join(shown)}")
    breakdown = "; ".join(parts)
    lines.append(f"  {'':<22} predicted {human(memory['predicted_peak_bytes'])}{ratio}" + (f" ({breakdown})" if breakdown else ""))
    return lines


def render(summary: dict) -> str:
    b = summary["build"]
    mesh = ",".join(f"{a}={d}" for a, d in zip(summary["mesh"]["axes"], summary["mesh"]["shape"]))
    lines = [
        f"artifact   {summary['path']}  (format {summary['format_version']}, torch {summary['torch_version']}, aot {summary['aot_version']})",
        f"model      {b.get('model_file')}  sha256 {str(b.get('model_sha256'))[:16]}...  seed {b.get('seed')}",
        f"topology   {summary['topology']['name']}  sha256 {summary['topology']['sha256'][:16]}...",
        f"mesh       {mesh}  (world size {summary['world_size']}, batch {b.get('batch_size')} per data-parallel rank)",
    ]
    placement = summary.get("placement") or {}
    physical = placement.get("physical_rank_of_mesh_rank") or []
    if physical != list(range(len(physical))):  # mesh rank r does not run on rank r: say where it does
        listed = ",".join(map(str, physical[:16])) + (",..." if len(physical) > 16 else "")
        lines.append(
            f"placement  mesh rank -> rank {listed}  (axes outermost first: {', '.join(placement.get('axes_outer_to_inner', []))}; ranks below are torchrun's)"
        )
    lines.append(f"optimizer  {summary['optimizer']}")
    lines.append(f"precision  {describe_precision(summary['precision'])}")
    if summary.get("batchnorm"):
        lines.append(f"batchnorm  {describe_batchnorm(summary['batchnorm'])}")
    if summary.get("replicas") is not None:
        lines.append(f"replicas   {describe_replicas(summary['replicas'])} (proved from the graph at build)")
        lines += replica_lines(summary["replicas"])
    init = summary["init"]  # the manifest schema requires it; summarize() always copies it
    lines.append(
        f"weights    none stored: each rank makes its own piece with the init program ({init['file']}, "
        f"{init['graph_nodes']} ops, seed {b.get('seed')}) or reads it with --init-from"
    )
    lines.append("programs")
    for name, p in summary["programs"].items():
        lines.append(
            f"  {name:<10} {p['graph_nodes']} graph nodes, ranks {rank_ranges(p['ranks'])}, "
            f"{p['collectives_per_step']} collectives per step ({human(p['collective_bytes_per_step'])})"
        )
        kinds = Counter((c["kind"], c["group"], c["dtype"]) for c in p["collectives"])
        for (kind, group, dtype), count in kinds.items():
            size = sum(c["bytes"] for c in p["collectives"] if (c["kind"], c["group"], c["dtype"]) == (kind, group, dtype))
            lines.append(f"    {count} x {kind} over {group} ({dtype}), {human(size)} in all")
    tp = summary.get("tensor_parallel")
    if tp:
        cols = sorted(tp_layer(n, style) for n, style in tp["plan"].items() if style != "rowwise")
        rows = sorted(n for n, style in tp["plan"].items() if style == "rowwise")
        lines.append(f"tensor parallel over {tp['size']} ranks ({tp['group']}): column-wise {', '.join(cols)}; row-wise {', '.join(rows)}")
    lines.extend(describe_pipeline(summary.get("pipeline")))
    lines.extend(describe_experts(summary))
    inference = summary.get("inference")
    if inference:
        io = ", ".join(f"{i['name']} [{', '.join(map(str, i['shape']))}] {i['dtype']}" for i in inference["inputs"])
        lines.append(
            f"inference  {inference['file']}  ONNX opset {inference.get('opset')}, {io}, "
            f"max |ONNX Runtime - eager| {inference.get('max_abs_diff', float('nan')):.2g} at build"
        )
    else:
        lines.append("inference  none (built with --no-onnx, or the model could not be exported)")
    compiled = summary.get("compiled")
    if compiled:  # `aot build --compile aoti`: the package `aot run` uses where device and torch match
        device = compiled["device"]
        level = device.get("capability") if device["kind"] == "cuda" else f"{device.get('arch')}, {device.get('isa')}"
        files = ", ".join(p["file"] for p in compiled["programs"].values())
        lines.append(f"compiled   {files}  AOTInductor for {device['kind']} ({level}), torch {compiled['torch_version']}")
    else:
        lines.append("compiled   none (portable program only; `aot build --compile aoti` adds a compiled package)")
    if summary.get("custom_ops"):
        lines.append(f"custom ops {', '.join(summary['custom_ops']['ops'])}  (runner imports {', '.join(summary['custom_ops']['modules'])})")
    lines.extend(describe_memory(summary.get("memory")))
    lines.append(describe_time(summary.get("time")))
    plan = summary.get("plan")
    if plan:  # written by `aot build --strategy auto`: the planner's predictions for this artifact
        p = plan.get("predicted", {})
        mem = p.get("memory_bytes", {})
        recompute = f", recomputing at activation budget {plan['recompute']:g}" if plan.get("recompute") is not None else ""
        lines.append(
            f"plan       {plan.get('strategy')}, bucket {plan.get('bucket_mb')} MiB{recompute}, chosen by {plan.get('source')} on "
            f"{plan.get('topology')} ({'calibrated' if plan.get('calibrated') else 'uncalibrated'})"
        )
        lines.append(
            f"  predicted {p.get('step_s', 0) * 1e3:.3g} ms per step (compute {p.get('compute_s', 0) * 1e3:.3g} ms, "
            f"communication {p.get('comm_s', 0) * 1e3:.3g} ms of which {p.get('exposed_comm_s', 0) * 1e3:.3g} ms exposed), "
            f"{human(mem.get('peak', 0))} per rank (parameters {human(mem.get('params', 0))}, optimizer "
            f"{human(mem.get('optimizer', 0))}, activations and gradients at peak {human(mem.get('peak_transient', 0))})"
        )
        if plan.get("timeline"):
            lines.append(f"  predicted timeline {plan['timeline']} (Chrome trace: Perfetto or chrome://tracing)")
    measured = summary.get("measured")
    if measured:
        lines.append(f"measured   {measured['steps_profiled']} profiled step(s), {measured['tier']} tier (Chrome trace: {measured['trace']})")
        labels = {"step_s": "step", "compute_s": "compute", "exposed_comm_s": "exposed communication"}
        for key, row in measured["times"].items():
            predicted = (
                f"predicted {row['predicted'] * 1e3:.3g} ms, measured/predicted {row['ratio']:.2f}"
                if row["predicted"]
                else "no prediction (built before aot predicted every build's step)"
            )
            lines.append(f"  {labels[key]:<22} measured {row['measured'] * 1e3:.3g} ms; {predicted}")
        lines.extend(_memory_lines(measured.get("memory")))
    lines.append("ranks")
    seen, shown = set(), 0
    for r in summary["ranks"]:
        key = (r["program"], r["parameters"], r["state_shard"])
        if key in seen and len(summary["ranks"]) > 4:
            continue  # large worlds: one line per distinct (program, state) is enough
        seen.add(key)
        shown += 1
        coords = ",".join(f"{k}={v}" for k, v in r["coords"].items())
        lines.append(
            f"  rank {r['rank']:<4} {r['program']}  {coords}  {r['parameters']:,} parameters ({human(r['parameter_bytes'])}), "
            f"{human(r['training_state_bytes'])} with gradients and optimizer state"
        )
    if shown < len(summary["ranks"]):
        lines.append(f"  ... {len(summary['ranks'])} ranks in all; ranks not shown match one above")
    lines.append(f"files ({human(summary['total_bytes'])} in all)")
    for path, f in summary["files"].items():
        lines.append(f"  {path:<42} {human(f['size']):>10}  sha256 {f['sha256'][:16]}...")
    return "\n".join(lines)
