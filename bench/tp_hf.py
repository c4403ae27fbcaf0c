"""Benchmark: what tensor parallelism splits in transformers' own models, per rank.

    python bench/tp_hf.py [--tp 2] [--json]

For transformers' Llama (grouped-query attention), Qwen2, GPT-2 (Conv1D, fused q/k/v) and Mixtral
(mixture of experts) at the tiny sizes of tests/models/hf_*.py, the script builds an artifact at
`--strategy tp=N` on N ranks (`aot build --no-onnx`) and reads from `aot inspect --json` the
parameters rank 0 holds against the model's total, and the collectives of one training step (count
and bytes); from the manifest, the layers split. A model whose attention stays whole holds most
of its parameters on every rank; one split as Megatron splits it holds about 1/N of its
projections (embeddings, norms and the output head stay whole by design).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("hf_llama.py", "hf_qwen2.py", "hf_gpt2.py", "hf_mixtral.py")


class Refused(Exception):
    """`aot build` refused the model (its one-line error)."""


def aot(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "aot", *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("aot: error: "):
        raise Refused(r.stderr.strip().splitlines()[-1].removeprefix("aot: error: "))
    if r.returncode != 0:
        sys.exit(f"failed: aot {' '.join(map(str, args))}\n{r.stderr[-2000:]}")
    return r


def measure(model: str, tp: int, folder: Path) -> dict:
    art = folder / model.removesuffix(".py")
    try:
        aot("build", REPO / "tests" / "models" / model, "--world-size", tp, "--strategy", f"tp={tp}", "--no-onnx", "--quiet", "-o", art)
    except Refused as e:
        return {"model": model, "refused": str(e)}
    summary = json.loads(aot("inspect", art, "--json").stdout)
    manifest = json.loads((art / "manifest.json").read_text())
    total = sum(math.prod(shape) for shape, _ in manifest["state"]["params"].values())
    plan = manifest["tensor_parallel"]["plan"]
    (program,) = summary["programs"].values()
    return {
        "model": model,
        "parameters": total,
        "per_rank": summary["ranks"][0]["parameters"],
        "split_layers": len(plan),
        "attention_split": any("attn" in name for name in plan),
        "fused_layers": sum(1 for style in plan.values() if ":" in style),
        "collectives_per_step": program["collectives_per_step"],
        "collective_bytes_per_step": program["collective_bytes_per_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(model, args.tp, Path(tmp)) for model in MODELS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"| model (tp={args.tp}) | parameters | per rank | per rank / total | layers split | attention split | collectives per step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['model']} | refused: {r['refused']} | | | | | |")
            continue
        fused = f" ({r['fused_layers']} fused)" if r["fused_layers"] else ""
        print(
            f"| {r['model']} | {r['parameters']:,} | {r['per_rank']:,} | {r['per_rank'] / r['parameters']:.2f} | {r['split_layers']}{fused} | "
            f"{'yes' if r['attention_split'] else 'no'} | {r['collectives_per_step']} ({r['collective_bytes_per_step'] / 1024:.0f} KiB) |"
        )


if __name__ == "__main__":
    main()
