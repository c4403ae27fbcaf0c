"""Benchmark: is a step ever waiting for its data? examples/gpt.py on 2 CPU ranks (dp=2) fed from
a 4 GiB llm.c token shard (2^31 random tokens, written here), in order and with --shuffle (every
window from anywhere in the file), against the example batch recorded in the artifact, the runs
alternated in one invocation. `aot run --metrics` records each step's `data_wait_s` (the time the
step waited for the prefetching reader, runner/execution/prefetch.py) and `step_time_s`.

    python bench/data_feed.py [--steps 60] [--rounds 2] [--batch-size 16] [--work /tmp/aot-data-feed]

Prints one row per feed: median step time, the exposed data time (sum of data waits over sum of
step times, the first step aside: it starts the reader) and rank 0's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def write_shard(path: Path, tokens: int, vocab: int) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, tokens
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        chunk = 1 << 26
        for start in range(0, tokens, chunk):
            f.write(rng.integers(0, vocab, size=min(chunk, tokens - start), dtype=np.uint16).tobytes())


def run(art: Path, steps: int, metrics: Path, extra: list[str]) -> list[dict]:
    metrics.unlink(missing_ok=True)
    cmd = [
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "aot",
        "run",
        str(art),
        "--steps",
        str(steps),
        "--metrics",
        str(metrics),
        "--quiet",
        *extra,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path("/tmp/aot-data-feed"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    shard = args.work / "tokens_4gib.bin"
    tokens = (4 * 2**30 - 1024) // 2
    if not shard.exists() or shard.stat().st_size != 4 * 2**30:
        print(f"writing {shard} (2^31 random tokens, 4 GiB) ...", file=sys.stderr)
        write_shard(shard, tokens, vocab=96)
    art = args.work / f"gpt-b{args.batch_size}-s{args.steps}"  # the schedule covers --steps
    if not art.exists():
        subprocess.run(
            [
                "aot",
                "build",
                str(REPO / "examples" / "gpt.py"),
                "--world-size",
                "2",
                "--batch-size",
                str(args.batch_size),
                "--no-onnx",
                "--max-steps",
                str(args.steps),
                "-o",
                str(art),
                "--quiet",
            ],
            check=True,
        )
    feeds = {"example batch": [], "4 GiB shard, in order": ["--data", str(shard)], "4 GiB shard, --shuffle": ["--data", str(shard), "--shuffle", "1"]}
    records: dict[str, list[dict]] = {name: [] for name in feeds}
    for _ in range(args.rounds):
        for name, extra in feeds.items():
            records[name] += run(art, args.steps, args.work / "metrics.jsonl", extra)[1:]  # the first step starts the reader
    print("| feed | step (median) | exposed data time | data wait (max) | rank 0 peak RSS |")
    print("|---|---|---|---|---|")
    for name, rows in records.items():
        step = statistics.median(r["step_time_s"] for r in rows)
        exposed = sum(r["data_wait_s"] for r in rows) / sum(r["step_time_s"] for r in rows)
        print(
            f"| {name} | {step * 1e3:.1f} ms | {exposed * 100:.2f}% | {max(r['data_wait_s'] for r in rows) * 1e3:.2f} ms | "
            f"{max(r['host_peak_rss_mib'] for r in rows):.0f} MiB |"
        )


if __name__ == "__main__":
    main()
