"""Benchmark: what an `aot build` costs as models and jobs grow: wall time, peak memory, artifact size.

    python bench/build_scale.py [--cases 8b:1024:fsdp,8b:1024:fsdp+tp,...] [--onnx] [--out results.json]

Each case is MODEL:WORLD:STRATEGY. MODEL is a preset of examples/llama.py (`1b`, `8b`, `70b`,
picked with AOT_SIZE) or `gpt2` (bench/models/gpt2_124m.py, GPT-2 small's shapes); STRATEGY is
`fsdp` (fsdp=WORLD) or `fsdp+tp` (tp=4 inside each node, fsdp over the rest). Every case is
`aot build MODEL --topology dgx_a100 --nodes WORLD/8 --world-size WORLD --strategy ... --batch-size 1`
run as a fresh process; its wall time is process start to exit (interpreter and torch import
included), its peak memory the child's maximum resident set size (os.wait4), and the artifact's
size the bytes of every file in it. --onnx keeps the inference export (default: --no-onnx, the
training artifact alone). The foreign CPU load during each build is recorded as in
bench/plan_accuracy.py, since this machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import REPO, busy_cpu_s, own_cpu_s  # noqa: E402

MODELS = {
    "gpt2": ("bench/models/gpt2_124m.py", None),
    "1b": ("examples/llama.py", "1b"),
    "8b": ("examples/llama.py", "8b"),
    "70b": ("examples/llama.py", "70b"),
}
DEFAULT_CASES = ",".join(f"{m}:{w}:{s}" for m in ("gpt2", "1b", "8b", "70b") for w in (8, 64, 1024) for s in ("fsdp", "fsdp+tp"))
TP = 4


def strategy_of(kind: str, world: int) -> str:
    return f"fsdp={world}" if kind == "fsdp" else f"fsdp={world // TP},tp={TP}"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _measured(model: str, world: int, kind: str, out: Path, onnx: bool) -> dict:
    """One build as a fresh process, waited for with os.wait4 to read that child's own peak memory."""
    path, size = MODELS[model]
    cmd = [
        sys.executable,
        "-m",
        "aot",
        "build",
        path,
        "--topology",
        "dgx_a100",
        "--nodes",
        str(max(1, world // 8)),
        "--world-size",
        str(world),
        "--strategy",
        strategy_of(kind, world),
        "--batch-size",
        "1",
        "-o",
        str(out),
        "--quiet",
        *([] if onnx else ["--no-onnx"]),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"AOT_SIZE": size} if size else {})}
    log = out.with_suffix(".log")
    t0, busy0, own0 = time.time(), busy_cpu_s(), own_cpu_s()
    with open(log, "w") as err:
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.time() - t0
    foreign = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / wall
    row = {
        "model": model,
        "world": world,
        "strategy": strategy_of(kind, world),
        "wall_s": round(wall, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "foreign_load_cores": round(foreign, 2),
    }
    if os.waitstatus_to_exitcode(status) != 0:
        return {**row, "error": log.read_text().strip()[-400:]}
    manifest = json.loads((out / "manifest.json").read_text())
    row.update(
        artifact_bytes=sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
        parameters=sum(_numel(shape) for shape, _ in manifest["state"]["params"].values()),
        program_nodes=manifest["programs"]["train"]["graph_nodes"],
        init_nodes=manifest["init"]["graph_nodes"],
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | params | ranks | strategy | build s | peak RSS GiB | artifact MiB | program nodes | foreign load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | {r['world']} | {r['strategy']} | failed: {r['error'].splitlines()[-1]} | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e9:.2f} B | {r['world']} | {r['strategy']} | {r['wall_s']} | "
            f"{r['peak_rss_bytes'] / 2**30:.2f} | {r['artifact_bytes'] / 2**20:.1f} | {r['program_nodes']} | "
            f"{r['foreign_load_cores']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated MODEL:WORLD:STRATEGY (default: every combination)")
    ap.add_argument("--onnx", action="store_true", help="keep the inference export in each build")
    ap.add_argument("--out", type=Path, help="write the rows and the machine to this JSON file")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aot-build-scale-") as scratch:
        for case in args.cases.split(","):
            row = _measured_case(case, args.onnx, Path(scratch))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        machine = {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        }
        args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


def _measured_case(case: str, onnx: bool, scratch: Path) -> dict:
    model, world, kind = case.split(":")
    out = scratch / case.replace(":", "-").replace("+", "_")
    try:
        return _measured(model, int(world), kind, out, onnx)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
