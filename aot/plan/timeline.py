"""The predicted per-rank timeline as a Chrome trace (opens in Perfetto or chrome://tracing).

Every rank runs the same program, so one rank's timeline stands for all: process "rank (every
rank)", thread 1 the compute stream (each graph op, and the stalls at waits), thread 2 the
communication stream (each collective with its bytes, group and algorithm). Times in microseconds
from the start of the step.
"""

from __future__ import annotations

from aot.plan.cost_model import Prediction

COMPUTE_TID, COMM_TID = 1, 2


def chrome_trace(prediction: Prediction, title: str = "") -> dict:
    events = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": f"predicted step (every rank){': ' + title if title else ''}"}},
        {"ph": "M", "pid": 0, "tid": COMPUTE_TID, "name": "thread_name", "args": {"name": "compute"}},
        {"ph": "M", "pid": 0, "tid": COMM_TID, "name": "thread_name", "args": {"name": "communication"}},
    ]
    for lane, name, what, start, seconds, args in prediction.events or ():
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": COMPUTE_TID if lane == "compute" else COMM_TID,
                "name": f"{what}" if lane == "comm" else name,
                "cat": lane,
                "ts": round(start * 1e6, 3),
                "dur": round(seconds * 1e6, 3),
                "args": {"node": name, "op": what, **{k: v for k, v in args.items() if v}},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "predicted_step_s": prediction.step_s,
            "compute_s": prediction.compute_s,
            "comm_s": prediction.comm_s,
            "exposed_comm_s": prediction.exposed_comm_s,
            "peak_memory_bytes": prediction.memory.peak,
        },
    }
