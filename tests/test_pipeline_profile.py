"""The pipeline's measured wait (`aot run --profile` on a pp artifact, runner/execution/profiling.py): each
rank's time in wait_tensor calls that waited for a stage transfer (a receive, or a send at the end
of the step), per profiled step, gathered to rank 0's profile.json.

In process: the attribution rule on a made-up event list (a wait that a gloo:recv / gloo:send
range ends inside waited for that transfer; any other wait for a collective). Under torchrun: a
2-rank pp=2 build of examples/mlp.py writes the new keys, every one a non-negative share of its
step, beside the keys profile.json had before.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers.commands import EXAMPLES, aot, ok, torchrun
from runner.execution.profiling import pipeline_summary, step_waits


def _event(name: str, start: float, end: float):
    """A torch.autograd.profiler FunctionEvent's fields that step_waits reads (times in us)."""
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_each_wait_is_attributed_to_the_transfer_that_finishes_inside_it():
    events = [
        _event("ProfilerStep*", 0, 1000),
        _event("gloo:send", 10, 900),  # issued first, waited at the end of the step
        _event("gloo:recv", 20, 300),  # its wait: 100-300
        _event("_c10d_functional::wait_tensor", 100, 300),
        _event("gloo:all_reduce", 420, 480),  # a collective's range ends on gloo's thread, not in its wait
        _event("_c10d_functional::wait_tensor", 400, 500),
        _event("_c10d_functional::wait_tensor", 850, 900),
        _event("ProfilerStep*", 1000, 3000),
        _event("gloo:recvAnySource", 1100, 1500),
        _event("_c10d_functional::wait_tensor", 1200, 1500),
    ]
    rows = step_waits(events, 3)
    assert rows[0] == pytest.approx({"step_s": 1e-3, "recv": 200e-6, "send": 50e-6, "collective": 100e-6})
    assert rows[1] == pytest.approx({"step_s": 2e-3, "recv": 300e-6, "send": 0.0, "collective": 0.0})
    assert all(v != v for v in rows[2].values())  # a step the events lack: NaN, never a made-up zero

    summary = pipeline_summary([rows, rows])
    per_step = summary["p2p_wait_s_per_step"]
    assert per_step[:2] == pytest.approx([250e-6, 300e-6]) and per_step[2] is None
    assert summary["p2p_wait_s"] == pytest.approx(275e-6)  # the median of the steps that have it
    rank = summary["pipeline_wait"]["per_rank"][1]
    assert rank["rank"] == 1 and rank["p2p_share"] == pytest.approx((0.25 + 0.15) / 2)
    assert rank["wait_share"] == pytest.approx((0.35 + 0.15) / 2)
    json.dumps(summary, allow_nan=False)  # NaN never reaches profile.json


@pytest.fixture(scope="module")
def pp_profile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp-profile")
    art, prof = folder / "mlp-pp2", folder / "prof"
    ok(aot("build", EXAMPLES / "mlp.py", "--strategy", "pp=2", "--batch-size", 4, "--no-onnx", "-o", art, "--quiet"))
    ok(torchrun(2, "run", art, "--steps", 4, "--profile", prof, "--quiet"))
    return json.loads((prof / "profile.json").read_text())


def test_pipeline_ranks_measure_their_transfer_waits(pp_profile):
    p = pp_profile
    # the keys profile.json had before are all still there
    for key in ("steps_profiled", "step_s", "step_s_profiled", "exposed_comm_s", "issue_comm_s", "compute_s", "memory"):
        assert key in p, key
    steps = p["steps_profiled"]
    assert steps == 3  # 4 steps: one warm-up, three profiled
    ranks = p["pipeline_wait"]["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert p["p2p_wait_s"] == ranks[0]["p2p_wait_s"]
    assert p["p2p_recv_wait_s"] == ranks[0]["recv_wait_s"] and p["p2p_send_wait_s"] == ranks[0]["send_wait_s"]
    assert p["p2p_wait_s_per_step"] == ranks[0]["per_step"]["p2p_wait_s"]
    for r in ranks:
        per_step = r["per_step"]
        assert all(len(v) == steps for v in per_step.values()), per_step
        for k in range(steps):
            step = per_step["step_s"][k]
            recv, send, coll = per_step["recv_wait_s"][k], per_step["send_wait_s"][k], per_step["collective_wait_s"][k]
            # every rank receives (activations forward, gradients back) and sends once per
            # microbatch, and each wait takes some time
            assert recv > 0 and send > 0 and coll >= 0, r
            assert per_step["p2p_wait_s"][k] == pytest.approx(recv + send)
            assert recv + send + coll < step, r
        for key in ("p2p_wait_s", "recv_wait_s", "send_wait_s", "collective_wait_s"):
            assert 0 <= r[key] < r["step_s"], (key, r)
        assert 0 < r["p2p_share"] <= r["wait_share"] < 1, r
    # every wait is a receive's, a send's or a collective's: the three add up to rank 0's
    # exposed communication (the mean over profiled steps of all its wait_tensor time)
    per_step = ranks[0]["per_step"]
    total = sum(per_step["p2p_wait_s"]) + sum(per_step["collective_wait_s"])
    assert total / steps == pytest.approx(p["exposed_comm_s"], rel=0.01)
