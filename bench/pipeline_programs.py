"""Benchmark: what one pipeline configuration costs the planner (aot plan, --strategy auto).

    python bench/pipeline_programs.py [--model examples/llama.py] [--size 8b] [--batch-size 8]
        [--topology dgx_h100] [--nodes 128] [--mesh pp=2,dp=16,fsdp=32] [--microbatches 4]
        [--schedule 1f1b] [--recompute]

Makes, in this process, the programs of every pipeline rank of one mesh and configuration as the
planner does (aot.plan.model_steps.ModelSteps.pipeline: the microbatch forward traced, cut into
stages, every rank's step captured and passed over; where a rank peaks over the profile's device
memory, other splits captured until every rank fits or the search stops,
aot/plan/pipeline_programs.py) and prints, as one JSON line: the wall seconds, how many rank
programs were captured (the balanced split's and each split tried) with each capture's seconds,
and every rank's predicted peak. Run it on a quiet machine; compare commits side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="examples/llama.py")
    ap.add_argument("--size", default="8b", help="AOT_SIZE for examples/llama.py")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--topology", default="dgx_h100")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--mesh", default="pp=2,dp=16,fsdp=32")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--recompute", action="store_true")
    args = ap.parse_args()
    os.environ["AOT_SIZE"] = args.size

    import aot.plan.pipeline_programs as programs
    from aot.plan.machine import Machine
    from aot.plan.model_steps import ModelSteps, Pricing
    from aot.plan.search import MEMORY_HEADROOM, MemoryLimit
    from runner.hardware.topology import for_nodes, load_profile

    degrees = {axis: int(n) for axis, n in (part.split("=") for part in args.mesh.split(","))}
    world = math.prod(degrees.values())
    profile = for_nodes(load_profile(args.topology), args.nodes, world)
    machine = Machine(profile, world)
    limit = MemoryLimit(MEMORY_HEADROOM * machine.memory_bytes) if machine.memory_bytes else None
    pricing = Pricing(profile, world, machine.per_node, None, None, limit, machine.compute)
    steps = ModelSteps(REPO / args.model, args.batch_size, 0, False, pricing)
    captures: list[float] = []
    capture = programs.capture_pipeline

    def timed(*a, **k):
        started = time.perf_counter()
        try:
            return capture(*a, **k)
        finally:
            captures.append(time.perf_counter() - started)

    programs.capture_pipeline = timed
    virtual = 2 if args.schedule == "interleaved-1f1b" else 1
    started = time.perf_counter()
    _, analyses = steps.pipeline(tuple(degrees), tuple(degrees.values()), args.microbatches, args.schedule, virtual, recompute=args.recompute)
    print(
        json.dumps(
            {
                "model": args.model,
                "size": args.size,
                "mesh": args.mesh,
                "microbatches": args.microbatches,
                "schedule": args.schedule,
                "recompute": args.recompute,
                "wall_s": round(time.perf_counter() - started, 1),
                "captures": len(captures),
                "capture_s": [round(s, 1) for s in captures],
                "peaks_gib": [round(a.memory.peak / 2**30, 1) for a in analyses],
                "limit_gib": round(limit.bytes / 2**30, 1) if limit else None,
            }
        )
    )


if __name__ == "__main__":
    main()
