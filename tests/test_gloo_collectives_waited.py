"""On gloo the runner waits for every collective where it is issued: never two in flight at once.

aot's programs issue collectives early and wait for them late (FSDP's parameter prefetch, gradient
reduce_scatters waited at the end of backward). Over gloo that put many collectives of one group in
flight together, which ProcessGroupGloo runs concurrently on its worker threads, and about one run
of 40 FSDP steps in eight died of heap corruption or a lost message (runner.execution.graph_loader.wait_at_issue).
This trains a real FSDP artifact on two gloo ranks through runner.Trainer and checks the program it
runs: the stored graph has several collectives in flight, the loaded one never more than one, and
gloo's poll threads run at the lowest priority.
"""

from __future__ import annotations

import json
import math
import textwrap

from helpers.commands import EXAMPLES, aot, ok, torchrun

WORKER = textwrap.dedent("""
    import json, os, sys
    from runner.execution.graph_loader import load_graph_module, most_in_flight
    from runner.execution.groups import leave_process_group
    from runner.execution.trainer import Trainer

    def poll_threads_nice():
        nice = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    nice.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        return nice

    artifact, out = sys.argv[1], sys.argv[2]
    trainer = Trainer(artifact, timeout_s=120)
    program = trainer.artifact.program(trainer.artifact.rank(trainer.rank)["program"])
    stored = load_graph_module(trainer.artifact.read(program["file"]))
    source = trainer.data_source()
    losses = [trainer.step(*source.batch(step)) for step in range(3)]
    report = {"loader": trainer.program_loader, "waited": trainer.collectives_waited_at_issue,
              "stored": most_in_flight(stored.graph), "loaded": most_in_flight(trainer._module.graph),
              "losses": losses, "poll_threads_nice": poll_threads_nice()}
    with open(f"{out}.{trainer.rank}.json", "w") as f:
        json.dump(report, f)
    leave_process_group()
""")


def test_fsdp_program_on_gloo_has_one_collective_in_flight(tmp_path):
    artifact = tmp_path / "art"
    ok(
        aot(
            "build",
            EXAMPLES / "mlp.py",
            "--world-size",
            "2",
            "--strategy",
            "fsdp=2",
            "--batch-size",
            "4",
            "--max-steps",
            "10",
            "--no-onnx",
            "--quiet",
            "-o",
            artifact,
        )
    )
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "report"
    ok(torchrun(2, worker, artifact, out, module=None))
    reports = [json.loads((tmp_path / f"report.{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["loader"] == "fx"
        assert report["stored"] > 1, "the built program should overlap its collectives (else this checks nothing)"
        assert report["waited"] is True
        assert report["loaded"] == 1, report
        assert all(math.isfinite(loss) for loss in report["losses"])
        # gloo's poll threads (one per group) yield their core to
        # the threads that carry the collectives (runner.execution.groups.yield_gloo_poll_threads)
        assert report["poll_threads_nice"] and set(report["poll_threads_nice"]) == {19}, report
    assert reports[0]["losses"] == reports[1]["losses"]  # the global loss, all-reduced: the same on both ranks


def test_cpu_packages_are_compiled_from_the_waited_program():
    """AOTInductor compiles a CPU package (gloo at run time) from a copy of the program with each
    collective waited at issue; the program the portable tier stores keeps its overlap."""
    import torch

    from aot.emit.aoti import _fake_groups, waited_at_issue
    from runner.execution.graph_loader import most_in_flight

    funcol = torch.ops._c10d_functional

    class TwoInFlight(torch.nn.Module):
        def forward(self, a, b):
            x = funcol.all_reduce(a * 2, "sum", "aot.dp")
            y = funcol.all_reduce(b + 1, "sum", "aot.dp")
            return funcol.wait_tensor(x) + funcol.wait_tensor(y)

    with _fake_groups({"aot.dp": 2}, 2):
        ep = torch.export.export(TwoInFlight(), (torch.ones(4), torch.ones(4)), strict=False)
        waited = waited_at_issue(ep)
    assert most_in_flight(ep.graph) == 2 and most_in_flight(waited.graph) == 1
    a, b = torch.arange(4.0), torch.ones(4)
    with _fake_groups({"aot.dp": 2}, 2):  # the fake group's all_reduce returns its input
        assert torch.equal(waited.module()(a, b), ep.module()(a, b))
