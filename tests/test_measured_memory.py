"""Measured peak memory per rank (`aot run --profile`, runner/execution/memory_tracking.py) and its
comparison with the build's prediction (`aot inspect --profile`)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.fx

from helpers.commands import EXAMPLES, aot, ok, torchrun
from runner.format.artifact import Artifact
from runner.commands.artifact_summary import compare_profile, render, summarize
from runner.execution.memory_tracking import ALLOCATOR, TRACKED, LiveBytes, measure_step
from runner.execution.profiling import read_summary

aten = torch.ops.aten
CPU = torch.device("cpu")


def _program(x, x_view, w, rows):
    a = aten.mul.Tensor(x, w)  # 256 B
    v = aten.view.default(a, [8, 8])  # a view: no new bytes
    c = aten.add.Tensor(v, 1.0)  # 256 B; a is freed once v is dropped after this op
    aten.relu_.default(c)  # in place: no new bytes
    d = aten.sum.default(c)  # 4 B
    e = aten.cat.default([c, c, c, c])  # 1024 B
    f = aten.sum.default(e)
    g = aten.add.Tensor(aten.sum.default(rows), aten.add.Tensor(f, d))
    return g, x_view


def _inputs():
    x, w = torch.randn(64), torch.randn(64)
    rows = torch.randn(64, 16)[:2]  # a batch that is a slice of a larger tensor: its own 128 B count
    return [x, x.view(8, 8), w, rows]


# Inputs: x 256 (x_view shares its storage: once) + w 256 + rows 128 = 640. Made storages: a 256
# (freed after op 3), c 256, d 4, e 1024 (freed after op 7), then three 4-byte sums. The peak is
# at cat: c + d + e live with the inputs. Were nothing freed it would be 640 + 1556 = 2196.
RESIDENT = 640
PEAK = 640 + 256 + 4 + 1024


def test_live_bytes_of_a_small_fx_program_are_exact():
    gm = torch.fx.symbolic_trace(_program)  # FX's code drops each value after its last use
    args = _inputs()
    with LiveBytes(args) as live:
        g, _ = gm(*args)
    assert live.resident == RESIDENT
    assert live.peak == PEAK
    assert live.live == g.untyped_storage().nbytes()  # only the program's new output is still held


def test_a_tensor_the_module_holds_counts_as_resident():
    """A constant the module holds (torch.export's path keeps some as attributes) is read by an op
    without having been declared as an input: it counts once, for the rest of the step."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(32))  # 128 B

        def forward(self, x):
            return aten.mul.Tensor(x, self.scale)  # 128 B

    gm = torch.fx.symbolic_trace(Scaled())
    x = torch.randn(32)
    with LiveBytes([x]) as live:
        gm(x)
    assert (live.resident, live.peak) == (256, 384)


def test_allocator_events_measure_the_same_peak():
    """The compiled tier's method (the CPU allocator's events under torch.profiler) on the same
    program: the same bytes, from the allocator instead of the ops."""
    gm = torch.fx.symbolic_trace(_program)
    args = _inputs()
    (_, _), (peak, how) = measure_step(gm, args, CPU, "compiled")
    assert (peak, how) == (PEAK, ALLOCATOR)
    (_, _), (peak, how) = measure_step(gm, args, CPU, "portable")
    assert (peak, how) == (PEAK, TRACKED)


@pytest.fixture(scope="module")
def mlp_builds(built):
    """examples/mlp.py for two ranks and for one (the session's builds: read-only)."""
    return built.many((EXAMPLES / "mlp.py", "--world-size", 2, "--no-onnx"), (EXAMPLES / "mlp.py", "--world-size", 1, "--no-onnx"))


def _resident_state(inspected: dict, rank: int) -> int:
    """Parameters and optimizer state the rank holds: its training state less the gradients."""
    r = inspected["ranks"][rank]
    return r["training_state_bytes"] - r["parameter_bytes"]


def test_run_profile_measures_each_ranks_peak_and_inspect_compares_it(mlp_builds, tmp_path):
    art, prof = mlp_builds[0], tmp_path / "prof"
    ok(torchrun(2, "run", art, "--steps", 4, "--profile", prof, "--quiet"))
    written_all = json.loads((prof / "profile.json").read_text())
    written = written_all["memory"]
    assert written["method"] == TRACKED and written["step"] == 1
    inspected = json.loads(ok(aot("inspect", art, "--profile", prof, "--json")).stdout)
    memory = inspected["measured"]["memory"]
    peaks = memory["measured_peak_bytes"]
    assert peaks == written["measured_peak_bytes"] and len(peaks) == 2
    for rank, peak in enumerate(peaks):
        assert peak > _resident_state(inspected, rank)
    assert memory["measured_max_bytes"] == max(peaks)
    predicted = memory["predicted_peak_bytes"]  # the goal: within 10% on CPU
    assert memory["ratio"] == pytest.approx(max(peaks) / predicted)
    assert 0.9 <= memory["ratio"] <= 1.1, memory
    # every build predicts its step time (manifest `time`), set beside the measured one
    manifest = json.loads((art / "manifest.json").read_text())
    step = inspected["measured"]["times"]["step_s"]
    assert step["predicted"] == manifest["time"]["predicted"]["step_s"] > 0
    assert step["ratio"] == pytest.approx(step["measured"] / step["predicted"])
    text = ok(aot("inspect", art, "--profile", prof)).stdout
    assert "peak memory" in text and "dispatch-mode tracking" in text and "measured/predicted" in text
    assert re.search(r"time +predicted [0-9.]+ ms per step on cpu \(uncalibrated\)", ok(aot("inspect", art)).stdout)

    # A profile written before memory was measured still compares its times (in process: the
    # command's own functions, without another start-up of torch).
    del written_all["memory"]
    summary = summarize(Artifact(art))
    summary["measured"] = compare_profile(summary, written_all)
    assert summary["measured"]["memory"] is None and "peak memory" not in render(summary)
    assert "exposed communication" in render(summary)


def test_single_process_run_measures_its_peak(mlp_builds, tmp_path):
    art, prof = mlp_builds[1], tmp_path / "prof"
    ok(aot("run", art, "--steps", 2, "--profile", prof, "--quiet"))
    summary = summarize(Artifact(art))
    memory = compare_profile(summary, read_summary(prof))["memory"]
    peaks = memory["measured_peak_bytes"]
    assert len(peaks) == 1 and peaks[0] > _resident_state(summary, 0)
    assert 0.9 <= memory["ratio"] <= 1.1, memory
