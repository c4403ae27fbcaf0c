"""The runner's step loop queues a step before reading the last one back (issue #46, item 3): on a
GPU the host is never waiting for the device inside the loop, and what a run prints and records is
what a loop reading every step at once would: the same losses, loss scales and skipped updates, in
step order. (That no launch waits for the device is checked on a GPU: tests/test_gpu.py.)"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from helpers.commands import EXAMPLES, MODELS, ok, torchrun
from runner.errors import AotError
from runner.execution.cuda_graphs import graphs_refused, resolve_graphs

WORKER = textwrap.dedent("""
    import contextlib, json, sys
    import torch
    from runner.execution.groups import leave_process_group
    from runner.execution.trainer import Trainer

    @contextlib.contextmanager
    def reads_refused():
        # every way a tensor's value reaches the host raises while launching
        ways = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
        saved = {way: getattr(torch.Tensor, way) for way in ways}
        def refuse(self, *args, **kwargs):
            raise AssertionError("a launch read a tensor's value back")
        for way in ways:
            setattr(torch.Tensor, way, refuse)
        try:
            yield
        finally:
            for way, f in saved.items():
                setattr(torch.Tensor, way, f)

    artifact, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    at_once, queued = Trainer(artifact), None
    source = at_once.data_source()
    read = []
    for step in range(steps):
        loss = at_once.step(*source.batch(step))
        read.append([loss, at_once.loss_scale(), at_once.last_step_skipped])
    queued = Trainer(artifact)
    batches = [source.batch(step) for step in range(steps)]
    with reads_refused():  # on a GPU each of these would wait for the device
        launched = [queued.launch(*batch) for batch in batches]  # nothing read yet
    later = [[s.loss(), s.loss_scale(), s.skipped()] for s in launched]
    with open(f"{out}.{queued.rank}.json", "w") as f:
        json.dump({"read": read, "later": later, "numbers": [s.number for s in launched]}, f)
    leave_process_group()
""")


def _compare(built, model, tmp_path, *args):
    art = built(model, "--no-onnx", *args)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ok(torchrun(1, script, art, tmp_path / "out", 6, module=None))
    return json.loads((tmp_path / "out.0.json").read_text())


def test_steps_read_back_after_later_steps_were_queued_give_the_same_figures(built, tmp_path):
    """fp16 with overflows (tests/models/fp16_overflow.py): a step's loss, the loss scale after it
    and whether its update was skipped are its own, read after five more steps have run, and a
    varying schedule still waits for skipped updates, picked on the device: no launch reads a
    tensor back (the worker refuses every read while launching)."""
    result = _compare(built, MODELS / "fp16_overflow.py", tmp_path)
    assert result["later"] == result["read"]
    assert result["numbers"] == [1, 2, 3, 4, 5, 6]
    assert any(skipped for _, _, skipped in result["read"]) and not all(skipped for _, _, skipped in result["read"])
    assert len({scale for _, scale, _ in result["read"]}) > 1  # the scale moved: each step kept its own


def test_the_run_loop_prints_and_records_every_step_in_order(built, tmp_path):
    """Steps read back one step late, but a replica check or a save reads its step at once (it
    reads the state that step left): records 1..7 in order, the checks and saves at their steps."""
    art = built(EXAMPLES / "mlp.py", "--world-size", 2, "--no-onnx")
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    r = ok(torchrun(2, "run", art, "--steps", 7, "--metrics", metrics, "--check-replicas", 3, "--save-every", 2, "--save", ckpt, "--log-every", 1))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [rec["step"] for rec in records] == list(range(1, 8))
    assert all(rec["step_time_s"] > 0 and rec["samples_per_s"] > 0 for rec in records)
    printed = [int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("step ")]
    assert printed == list(range(1, 8)), r.stderr
    assert json.loads((ckpt / "checkpoint.json").read_text())["step"] == 7


def test_cuda_graphs_are_captured_only_where_a_step_can_be():
    """`--cuda-graphs`: auto captures on a CUDA rank whose step a graph can hold, and runs
    uncaptured elsewhere (a CPU rank, a pipeline stage, collectives over gloo) without a word; on
    is an error there, naming why; off never captures. (The capture itself: tests/test_gpu.py.)"""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert graphs_refused(gpu, pipeline=False, host_collectives=False) is None
    assert "runs on cpu" in str(graphs_refused(cpu, pipeline=False, host_collectives=False))
    assert "pipeline" in str(graphs_refused(gpu, pipeline=True, host_collectives=False))
    assert "gloo" in str(graphs_refused(gpu, pipeline=False, host_collectives=True))
    assert resolve_graphs("auto", None) and resolve_graphs("on", None) and not resolve_graphs("off", None)
    assert not resolve_graphs("auto", "a reason") and not resolve_graphs("off", "a reason")
    with pytest.raises(AotError, match="--cuda-graphs on: a reason"):
        resolve_graphs("on", "a reason")
