"""Planning in worker processes (aot/plan/workers.py, aot/plan/layout_traces.py): the layout
classes traced at once in forked workers give the plans that tracing them one after another in
the planner's process gives, say what they trace as each starts, and carry back what failed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from click.testing import CliRunner

from aot.cli import cli
from aot.plan.search import MEMORY_HEADROOM
from aot.plan.workers import in_workers
from runner.hardware.topology import load_profile

MODELS = Path(__file__).resolve().parent / "models"
REPO = Path(__file__).resolve().parents[1]


def _plan(*args) -> dict:
    result = CliRunner().invoke(cli, ["plan", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out.pop("workers") == int(args[args.index("--workers") + 1])
    out.pop("seconds")
    spent = out.pop("time")  # where the time went: its parts add up to the whole, however many workers
    assert sum(s for part, s in spent.items() if part != "total_s") <= spent["total_s"] + 0.01, spent
    return out


def test_layout_classes_traced_in_workers_plan_what_one_process_plans(tmp_path):
    """llama8 (written out from 4, 5 and 6 of its 8 blocks) on 8 ranks over dp, fsdp and tp, of a
    dgx_a100 whose GPUs hold one byte less than the leanest plan needs (so the graphs are priced
    as traced and with recomputing variants): every plan, prediction, itemized memory and skipped
    mesh the same with 2 workers as with 1."""
    args = [str(MODELS / "llama8.py"), "--world-size", "8", "--axes", "dp,fsdp,tp"]
    roomy = _plan(*args, "--topology", "dgx_a100", "--workers", "2")
    profile = copy.deepcopy(load_profile("dgx_a100"))
    profile["name"] = "dgx_a100_tight"
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int((min(p["memory_bytes"]["peak"] for p in roomy["plans"]) - 1) / MEMORY_HEADROOM)
    (tmp_path / "tight.json").write_text(json.dumps(profile))
    tight = _plan(*args, "--topology", str(tmp_path / "tight.json"), "--workers", "2")
    assert tight == _plan(*args, "--topology", str(tmp_path / "tight.json"), "--workers", "1")
    assert any(p["recompute"] is not None for p in tight["plans"]) and len(tight["plans"]) > len(roomy["plans"])


def test_workers_announce_each_trace_as_it_starts_and_carry_back_failures():
    """The planner's notes come from its own process, in the order the traces start; a layout
    class that fails in a worker is skipped with the reason tracing it in the planner gives."""
    from aot.plan.search import plan_model
    from runner.hardware.topology import for_nodes, load_profile

    profile = for_nodes(load_profile("dgx_a100"), 1, 8)
    for model in (REPO / "examples" / "mlp.py", MODELS / "bad_tp_plan.py"):  # the second's tp plan names a module it lacks
        runs = {}
        for workers in (1, 2):
            said: list[str] = []
            plans, skipped, _, steps = plan_model(model, profile, 8, 8, axes=("dp", "fsdp", "tp"), note=said.append, workers=workers)
            priced = [(p.axes, p.shape, p.bucket_mb, p.prediction.step_s, p.prediction.memory.peak) for p in plans]
            runs[workers] = (said, priced, skipped, sorted(steps.traced))
        assert runs[1] == runs[2]
        said, _, skipped, _ = runs[2]
        first = "(1 of 4), 1 more graph(s) derived from it, then pricing the 4 meshes read from them"
        assert said[0].startswith("tracing the step on ") and said[0].endswith(first), said
    assert len(skipped) == 6 and all("tp_plan names module 'fc2', which the model does not have" in why for why in skipped), skipped


def test_in_workers_keeps_the_order_of_the_jobs_and_raises_what_a_job_raises():
    import os

    pids = in_workers(list(range(5)), lambda job: (job, os.getpid()), 2)
    assert [job for job, _ in pids] == list(range(5))
    assert os.getpid() not in {pid for _, pid in pids}  # forked: none ran here
    assert len({pid for _, pid in pids}) <= 2
    try:
        in_workers([1, 0], lambda job: 1 // job, 2)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("a job's error was not raised")


def test_pipeline_meshes_priced_in_workers_plan_what_one_process_plans():
    """examples/mlp.py on 4 ranks over dp, fsdp and pp: the pipeline meshes of each pp degree
    priced at once in workers (pp=2 with dp=2 and with fsdp=2; pp=4, refused: a stage without
    weights) give the plans and skipped meshes of pricing them one at a time."""
    args = [str(REPO / "examples" / "mlp.py"), "--topology", "dgx_a100", "--world-size", "4", "--batch-size", "8", "--axes", "dp,fsdp,pp"]
    apart = _plan(*args, "--workers", "2")
    assert apart == _plan(*args, "--workers", "1")
    assert {"pp=2,dp=2", "pp=2,fsdp=2"} <= {p["strategy"] for p in apart["plans"]}
    assert any(why.startswith("pp=4: pipeline rank 1 would hold no parameters") for why in apart["skipped"]), apart["skipped"]


def test_a_worker_that_dies_is_one_line_naming_fewer_workers(monkeypatch):
    """A worker killed mid-plan (the kernel's OOM killer, here os._exit) is one line that says how
    to plan with fewer; AOT_PLAN_WORKERS sets the default and is refused when it is not a count."""
    import os

    import pytest

    from aot.errors import AotError
    from aot.plan.workers import default_workers

    with pytest.raises(AotError) as died:
        in_workers([0, 1], lambda job: os._exit(9) if job else job, 2)
    assert "ended abruptly (out of memory?): plan with fewer, `aot plan --workers 1`" in str(died.value)
    monkeypatch.setenv("AOT_PLAN_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.setenv("AOT_PLAN_WORKERS", "many")
    with pytest.raises(AotError, match="AOT_PLAN_WORKERS='many': expected a whole number of processes"):
        default_workers()
