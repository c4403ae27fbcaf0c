"""`aot diff A B`: what changed from artifact A to artifact B, for a reviewer, at three levels.

build     the build's arguments, the torch and aot releases, the topology profile, the model
plan      mesh, placement, strategy, buckets, sharding, tensor and pipeline parallelism, precision,
          recomputation, NCCL algorithms; and the predicted step time and memory per rank, A and B
          side by side with the ratio B/A
programs  for each set of ranks that run the same program in A and the same in B: collectives per
          step (kind, group, dtype) added, removed or resized, and the graph's operators by count

Manifests are read through runner.format.artifact and described with runner.commands.artifact_summary's functions;
programs are read as the JSON the artifact stores (verified, never deserialized), so artifacts of
another torch release compare too. Every file both manifests list is checked against its sha256
first: "identical" (equal manifest digests) then means every byte of the two artifacts is equal.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from runner.format.artifact import Artifact
from runner.errors import AotError
from runner.commands.formatting import human, rank_ranges, tp_layer
from runner.commands.artifact_summary import describe_capacity, predicted_memory, predicted_time, summarize
from runner.format.integrity import read_verified

# build arguments the plan level shows (with what the build made of them)
_PLAN_ARGUMENTS = ("strategy", "bucket_mb", "prefetch_mb", "hierarchical")
_OPS_SHOWN = 20  # text output: the operators whose count changed most; --json lists all
_LABEL = 26  # text output: width of the labels column


def open_verified(path: str | Path) -> Artifact:
    """The artifact at `path`, each file its manifest lists checked against its sha256."""
    artifact = Artifact(path, any_torch=True)
    for relpath, entry in artifact.manifest["files"].items():
        read_verified(artifact.root, relpath, entry)
    return artifact


def op_counts(artifact: Artifact, program: str) -> Counter:
    """How often the program's graph calls each operator (`aten.mm`, `aten.add.Tensor`,
    `_c10d_functional.all_reduce`), from its stored JSON."""
    relpath = artifact.program(program)["file"]
    try:
        nodes = json.loads(artifact.read(relpath))["graph_module"]["graph"]["nodes"]
        return Counter(_op_name(node["target"]) for node in nodes)
    except (KeyError, TypeError, ValueError):
        raise AotError(f"{artifact.root / relpath}: not a program in torch's export schema") from None


def _op_name(target: str) -> str:
    name = target.removeprefix("torch.ops.")
    return name.removesuffix(".default")


def _optimizer(optimizer: dict) -> str:
    groups = [", ".join(f"{k}={v}" for k, v in sorted(g.items()) if k != "params") for g in optimizer.get("param_groups", [])]
    return optimizer["class"] + "".join(f" ({g})" for g in groups)


def _build_fields(m: dict) -> dict:
    """Level 1, compared as is: releases, topology profile, model, build arguments."""
    fields = {
        "torch_version": m["torch_version"],
        "aot_version": m.get("aot_version"),
        "format_version": m["format_version"],
        "topology_profile": f"{m['topology']['name']} (sha256 {m['topology']['sha256'][:16]}...)",
        "world_size": m["world_size"],
        "parameters": sum(math.prod(shape) for shape, _ in m["state"]["params"].values()),
        "optimizer": _optimizer(m["state"]["optimizer"]),
    }
    fields.update({k: v for k, v in m["build"].items() if k not in _PLAN_ARGUMENTS and k not in fields})
    return fields


def _plan_fields(m: dict, s: dict) -> dict:
    """Level 2, compared as is: how the step is distributed and computed."""
    plan, build = m.get("plan") or {}, m["build"]
    physical = (m.get("placement") or {}).get("physical_rank_of_mesh_rank")
    sharding, tp, pipeline = m.get("sharding"), m.get("tensor_parallel"), m.get("pipeline")
    recompute = (m.get("memory") or {}).get("recompute")
    return {
        "strategy": f"auto, chose {plan.get('strategy')}" if plan else build.get("strategy"),
        "mesh": ",".join(f"{a}={d}" for a, d in zip(m["mesh"]["axes"], m["mesh"]["shape"])),
        "placement": "identity" if not physical or physical == list(range(len(physical))) else physical,
        "bucket_mb": plan.get("bucket_mb", build.get("bucket_mb")),
        "prefetch_mb": build.get("prefetch_mb"),
        "hierarchical": build.get("hierarchical"),
        "hierarchical_groups": sorted(n for n, g in m["process_groups"].items() if g.get("level")) or None,
        "sharding": sharding and f"{sharding['axis']}={sharding['size']} over {sharding['group']}, {sharding.get('layout')}",
        "tensor_parallel": tp
        and {
            "size": tp["size"],
            "sequence_parallel": tp.get("sequence_parallel"),
            "colwise": sorted(tp_layer(n, st) for n, st in tp["plan"].items() if st != "rowwise"),
            "rowwise": sorted(n for n, st in tp["plan"].items() if st == "rowwise"),
        },
        "expert_parallel": m.get("expert_parallel")
        and (
            f"ep={m['expert_parallel']['size']} over {m['expert_parallel']['group']}, {len(m['expert_parallel']['experts'])} experts layer(s), "
            f"capacity {describe_capacity(m['expert_parallel']['capacity'])}"
        ),
        "pipeline": pipeline
        and (
            f"pp={pipeline['size']} {pipeline['schedule']}, {pipeline['microbatches']} microbatches "
            f"of {pipeline['microbatch_size']}, {pipeline['stages_per_rank']} stage(s) per rank"
        ),
        "precision": s["precision"],
        "recompute": recompute and {k: recompute[k] for k in ("policy", "source", "recomputed_values") if k in recompute},
        "nccl_algo": plan.get("nccl_algo"),
        "algorithms": (plan.get("predicted") or {}).get("algorithms"),
    }


def _plan_numbers(s: dict) -> dict:
    """Level 2, side by side: the build's predictions for one rank's step."""
    time = predicted_time(s)
    memory, _ = predicted_memory(s)
    return {
        "step_s": time.get("step_s"),
        "compute_s": time.get("compute_s"),
        "comm_s": time.get("comm_s"),
        "exposed_comm_s": time.get("exposed_comm_s"),
        "peak_memory_bytes": memory["peak"] if memory else None,
        # parameters, their gradients and optimizer state of the rank that holds the most
        "training_state_bytes": max(r["training_state_bytes"] for r in s["ranks"]),
    }


def _changed(fields_a: dict, fields_b: dict) -> list[dict]:
    return [
        {"field": k, "a": fields_a.get(k), "b": fields_b.get(k)}
        for k in [*fields_a, *(k for k in fields_b if k not in fields_a)]
        if fields_a.get(k) != fields_b.get(k)
    ]


def _side_by_side(a: dict, b: dict) -> dict:
    return {k: {"a": a[k], "b": b[k], "ratio": b[k] / a[k] if a[k] and b[k] is not None else None} for k in a}


def _collectives(program: dict | None) -> dict[tuple, list[int]]:
    """(kind, group, dtype) -> the bytes of each, in issue order."""
    found: dict[tuple, list[int]] = {}
    for c in (program or {}).get("collectives", []):
        found.setdefault((c["kind"], c["group"], c.get("dtype")), []).append(c["bytes"])
    return found


def collective_changes(program_a: dict | None, program_b: dict | None) -> list[dict]:
    """The (kind, group, dtype) collectives of one step that differ: added, removed, resized
    (count or bytes changed) or reordered (the same sizes in another order)."""
    in_a, in_b = _collectives(program_a), _collectives(program_b)
    changes = []
    # removed first, then changed, then added, as diff lists them
    for key in sorted(set(in_a) | set(in_b), key=lambda k: (2 if k not in in_a else 0 if k not in in_b else 1, *map(str, k))):
        sizes_a, sizes_b = in_a.get(key, []), in_b.get(key, [])
        if sizes_a == sizes_b:
            continue
        change = "added" if not sizes_a else "removed" if not sizes_b else "reordered" if sorted(sizes_a) == sorted(sizes_b) else "resized"
        kind, group, dtype = key
        changes.append(
            {
                "kind": kind,
                "group": group,
                "dtype": dtype,
                "change": change,
                "a": {"count": len(sizes_a), "bytes": sum(sizes_a), "sizes": sizes_a},
                "b": {"count": len(sizes_b), "bytes": sum(sizes_b), "sizes": sizes_b},
            }
        )
    return changes


def _program_pairs(a: Artifact, b: Artifact) -> dict[tuple, list[int]]:
    """(program in A, program in B) -> the ranks that run them (None where a side has no such rank)."""
    runs_a = {r["rank"]: r["program"] for r in a.manifest["ranks"]}
    runs_b = {r["rank"]: r["program"] for r in b.manifest["ranks"]}
    pairs: dict[tuple, list[int]] = {}
    for rank in sorted(set(runs_a) | set(runs_b)):
        pairs.setdefault((runs_a.get(rank), runs_b.get(rank)), []).append(rank)
    return pairs


def _compare_programs(a: Artifact, b: Artifact) -> list[dict]:
    counted: dict[tuple, Counter] = {}

    def ops(artifact: Artifact, name: str | None) -> Counter:
        if name is None:
            return Counter()
        if (id(artifact), name) not in counted:
            counted[id(artifact), name] = op_counts(artifact, name)
        return counted[id(artifact), name]

    result = []
    for (name_a, name_b), ranks in _program_pairs(a, b).items():
        program_a = a.program(name_a) if name_a else None
        program_b = b.program(name_b) if name_b else None
        ops_a, ops_b = ops(a, name_a), ops(b, name_b)
        totals = {
            side: {
                "collectives_per_step": len(p["collectives"]) if p else 0,
                "collective_bytes_per_step": sum(c["bytes"] for c in p["collectives"]) if p else 0,
                "graph_nodes": p.get("graph_nodes") if p else 0,
            }
            for side, p in (("a", program_a), ("b", program_b))
        }
        op_rows = [{"op": op, "a": ops_a[op], "b": ops_b[op]} for op in sorted(set(ops_a) | set(ops_b)) if ops_a[op] != ops_b[op]]
        op_rows.sort(key=lambda r: -abs(r["b"] - r["a"]))  # stable: by name among equal changes
        result.append(
            {
                "ranks": ranks,
                "a": name_a,
                "b": name_b,
                **_side_by_side(totals["a"], totals["b"]),
                "collectives": collective_changes(program_a, program_b),
                "ops": op_rows,
            }
        )
    return result


def _file_changes(files_a: dict, files_b: dict) -> list[dict]:
    rows = []
    for path in sorted(set(files_a) | set(files_b)):
        ea, eb = files_a.get(path), files_b.get(path)
        if ea != eb:
            rows.append(
                {"path": path, "change": "added" if ea is None else "removed" if eb is None else "changed", "a": ea and ea["size"], "b": eb and eb["size"]}
            )
    return rows


def compare(path_a: str | Path, path_b: str | Path) -> dict:
    """What changed from artifact A to artifact B (JSON-ready; `render` prints it)."""
    a, b = open_verified(path_a), open_verified(path_b)
    ma, mb = a.manifest, b.manifest
    sa, sb = summarize(a), summarize(b)
    result = {"a": str(path_a), "b": str(path_b), "identical": ma["digest"] == mb["digest"], "digest": {"a": ma["digest"], "b": mb["digest"]}}
    result["build"] = _changed(_build_fields(ma), _build_fields(mb))
    result["plan"] = {
        "changed": _changed(_plan_fields(ma, sa), _plan_fields(mb, sb)),
        "predicted": _side_by_side(_plan_numbers(sa), _plan_numbers(sb)),
        "topology": {"a": (ma.get("time") or {}).get("topology"), "b": (mb.get("time") or {}).get("topology")},
    }
    result["programs"] = _compare_programs(a, b)
    result["files"] = _file_changes(ma["files"], mb["files"])
    result["manifest_entries_changed"] = sorted(k for k in set(ma) | set(mb) if k != "digest" and ma.get(k) != mb.get(k))
    return result


# -- text ------------------------------------------------------------------------------------------


def _show(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:16] + "..."  # a sha256
    if isinstance(value, list):
        shown = [_show(v) for v in value[:8]]
        return "[" + ", ".join(shown) + (f", ... {len(value)} in all" if len(value) > 8 else "") + "]"
    if isinstance(value, dict):
        return " ".join(f"{k}={_show(v)}" for k, v in value.items())
    return str(value)


def _field_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        a, b = _show(row["a"]), _show(row["b"])
        if len(a) + len(b) <= 80:
            lines.append(f"  {row['field']:<{_LABEL}} {a} -> {b}")
        else:  # long values (optimizer hyperparameters, tensor-parallel plans): one line each
            lines += [f"  {row['field']:<{_LABEL}} A {a}", f"  {'':<{_LABEL}} B {b}"]
    return lines


_NUMBERS = {
    "step_s": ("step time", lambda s: f"{s * 1e3:.3g} ms"),
    "compute_s": ("  compute", lambda s: f"{s * 1e3:.3g} ms"),
    "comm_s": ("  communication", lambda s: f"{s * 1e3:.3g} ms"),
    "exposed_comm_s": ("  exposed", lambda s: f"{s * 1e3:.3g} ms"),
    "peak_memory_bytes": ("peak memory per rank", human),
    "training_state_bytes": ("training state per rank", human),
}


def _number_line(label: str, row: dict, show, indent: int = 2) -> str:
    a = show(row["a"]) if row["a"] is not None else "none"
    b = show(row["b"]) if row["b"] is not None else "none"
    ratio = f"B/A {row['ratio']:.2f}" if row["ratio"] is not None else ""
    return f"{'':<{indent}}{label:<{_LABEL + 2 - indent}} {a:>10} -> {b:<10} {ratio}".rstrip()


def _collective_line(c: dict) -> str:
    what = f"{c['kind']} over {c['group']}" + (f" ({c['dtype']})" if c["dtype"] else "")
    a, b = (f"{c[s]['count']} x, {human(c[s]['bytes'])}" for s in ("a", "b"))
    if c["change"] == "added":
        return f"    + {what}: {b}"
    if c["change"] == "removed":
        return f"    - {what}: {a}"
    return f"    ~ {what}: {a} -> {b}" + (" (same sizes, another order)" if c["change"] == "reordered" else "")


def _program_lines(p: dict) -> list[str]:
    ranks = f"rank{'s' if len(p['ranks']) > 1 else ''} {rank_ranges(p['ranks'])}"
    count, size = p["collectives_per_step"], p["collective_bytes_per_step"]
    if p["a"] is None or p["b"] is None:  # a world size that changed: these ranks exist on one side
        side = "a" if p["b"] is None else "b"
        return [
            f"  {ranks}: only in {side.upper()}, running {p[side]} ({count[side]} collectives per step, "
            f"{human(size[side])}; {p['graph_nodes'][side]} graph nodes)"
        ]
    names = p["a"] if p["a"] == p["b"] else f"{p['a']} -> {p['b']}"
    if not p["collectives"] and not p["ops"] and count["a"] == count["b"] and size["a"] == size["b"]:
        return [f"  {ranks}: {names}, same collectives ({count['a']} per step) and ops"]
    lines = [f"  {ranks}: {names}", _number_line("collectives per step", count, str, indent=4), _number_line("  bytes", size, human, indent=4)]
    lines += [_collective_line(c) for c in p["collectives"]]
    lines.append(_number_line("graph nodes", p["graph_nodes"], str, indent=4))
    if p["ops"]:
        lines.append("    ops whose count changed:")
        width = max(len(r["op"]) for r in p["ops"][:_OPS_SHOWN])
        lines += [f"      {r['op']:<{width}}  {r['a']} -> {r['b']}" for r in p["ops"][:_OPS_SHOWN]]
        if len(p["ops"]) > _OPS_SHOWN:
            lines.append(f"      ... {len(p['ops']) - _OPS_SHOWN} more (--json lists all)")
    return lines


def render(d: dict) -> str:
    if d["identical"]:
        return f"identical: {d['a']} and {d['b']} (manifest digest {d['digest']['a'][:16]}..., every listed file's sha256 checked)"
    lines = [f"A  {d['a']}", f"B  {d['b']}"]
    lines += ["build"] + (_field_lines(d["build"]) or ["  same releases, topology profile, model and arguments"])
    lines.append("plan")
    lines += _field_lines(d["plan"]["changed"])
    topology = d["plan"]["topology"]
    on = topology["a"] if topology["a"] == topology["b"] else f"{topology['a']} / {topology['b']}"
    lines.append(f"  predicted for one rank's step on {on}:")
    for key, (label, show) in _NUMBERS.items():
        lines.append(_number_line(label, d["plan"]["predicted"][key], show))
    lines.append("programs")
    for p in d["programs"]:
        lines += _program_lines(p)
    if d["files"]:
        lines.append("files")
        for f in d["files"]:
            sizes = {"added": lambda: human(f["b"]), "removed": lambda: human(f["a"]), "changed": lambda: f"{human(f['a'])} -> {human(f['b'])}"}[f["change"]]()
            lines.append(f"  {f['path']:<40} {f['change']}, {sizes}")
    lines.append(f"different: manifest entries {', '.join(d['manifest_entries_changed'])}")
    return "\n".join(lines)
