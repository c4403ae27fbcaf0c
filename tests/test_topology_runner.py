"""End to end on this CPU machine: an artifact built for a DGX A100 meets hardware that is not one.

`aot build --topology dgx_a100`, then `aot run` under torchrun as a user would: refused before any
collective with one line per mismatch class and a one-line error per rank (no traceback of
aot's), run with a warning under --allow-topology-mismatch, and refused with the node count
when torchrun spreads the job over two (local) nodes.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from helpers.commands import REPO, aot, clean_env, ok, show, torchrun
from runner.hardware.topology_check import TopologyRefusal

AOT_FRAME = re.compile(r'File "[^"]*[/\\](aot|runner)[/\\][^"]*\.py", line \d+')
MISMATCH = re.compile(r"^\[rank (\d+)\] topology mismatch: (.*)$", re.M)
ERROR = re.compile(r"^aot: error: \[rank (\d+)\] (.*)$", re.M)


@pytest.fixture(scope="module")
def dgx_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("topology") / "dgx"
    ok(aot("build", REPO / "examples" / "mlp.py", "--topology", "dgx_a100", "--world-size", "2", "-o", out, "--quiet", "--no-onnx"))
    return out


def refused(r: subprocess.CompletedProcess) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    assert r.returncode != 0, show(r)
    assert not AOT_FRAME.search(r.stderr) and "internal error" not in r.stderr, show(r)
    assert "ready in" not in r.stderr and "step " not in r.stderr, show(r)  # nothing ran
    return MISMATCH.findall(r.stderr), ERROR.findall(r.stderr)


def test_dgx_artifact_is_refused_on_this_machine(dgx_artifact):
    r = torchrun(2, "run", dgx_artifact, "--steps", "2")
    mismatches, errors = refused(r)
    assert mismatches == [
        ("0", "GPU count: profile 'dgx_a100' expects 8 GPUs per node (NVIDIA A100-SXM4-80GB); this node has none"),
        ("0", "NIC: profile 'dgx_a100' expects 8 NICs at 200 Gb/s; this node has none"),
    ], show(r)  # local rank 0 reports for its node
    assert sorted(rank for rank, _ in errors) == ["0", "1"], show(r)
    for _, line in errors:
        assert "live topology differs from the artifact's profile 'dgx_a100' in 2 ways" in line
        assert "--allow-topology-mismatch" in line


def test_a_rank_that_does_not_list_the_mismatches_exits_after_the_one_that_does():
    """torchrun kills the other ranks when the first one exits: were rank 1 to go first, rank 0's
    list of mismatches could be cut off. Rank 1 waits on torchrun's agent store (a real TCPStore
    here) until rank 0 has printed and says so."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "LOCAL_WORLD_SIZE": "2",
    }
    follower = subprocess.Popen(
        [sys.executable, "-c", "from runner.hardware.topology_check import TopologyRefusal; TopologyRefusal('refused').before_exit(); print('exiting')"],
        cwd=REPO,
        env={**clean_env(), **env, "LOCAL_RANK": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3)
        assert follower.poll() is None  # still waiting for its node's local rank 0
        TopologyRefusal("refused", env={**env, "LOCAL_RANK": "0"}).before_exit()
        out, _ = follower.communicate(timeout=30)
        assert follower.returncode == 0 and out.strip() == "exiting"
    finally:
        follower.kill()
    # another node's ranks, or the next torchrun attempt, wait for their own
    assert agent.check(["aot/attempt-0/refused/node-0/local-0", "aot/attempt-0/refused/node-0/local-1"])
    assert not agent.check(["aot/attempt-1/refused/node-0/local-0"])
    assert not agent.check(["aot/attempt-0/refused/node-1/local-0"])


def test_allow_topology_mismatch_runs_with_a_warning(dgx_artifact):
    r = ok(torchrun(2, "run", dgx_artifact, "--steps", "2", "--allow-topology-mismatch"))
    warnings = [l for l in r.stderr.splitlines() if l.startswith("warning: ")]
    assert warnings[0] == (
        "warning: running on hardware that differs from the artifact's topology profile 'dgx_a100' "
        "(--allow-topology-mismatch): its schedule was tuned for other hardware"
    ), show(r)
    assert warnings[1:] == [
        "warning: topology mismatch: GPU count: profile 'dgx_a100' expects 8 GPUs per node (NVIDIA A100-SXM4-80GB); this node has none",
        "warning: topology mismatch: NIC: profile 'dgx_a100' expects 8 NICs at 200 Gb/s; this node has none",
    ], show(r)  # once per node, not once per rank
    assert "trained" in r.stderr and "step     2" in r.stderr, show(r)


def test_node_count_is_checked_across_nodes(dgx_artifact):
    """Two torchrun agents on this machine form a 2-node job (c10d rendezvous): the profile is for 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "aot-topology-test"]
    launcher = ["--nnodes", 2, "--nproc-per-node", 1, *rendezvous]
    with ThreadPoolExecutor(2) as pool:  # one agent per node, each torchrun forked as the tests' are
        results = list(pool.map(lambda _: torchrun(1, "run", dgx_artifact, "--steps", 1, launcher=launcher), range(2)))
    for r in results:
        mismatches, errors = refused(r)
        # each node's local rank 0 reports; the node count comes first
        assert [line.split(":")[0] for _, line in mismatches] == ["node count", "GPU count", "NIC"], show(r)
        assert mismatches[0][1] == "node count: profile 'dgx_a100' is for 1 node; this job runs on 2", show(r)
        assert len(errors) == 1 and "in 3 ways" in errors[0][1], show(r)


def test_runner_load_logs_what_aot_run_prints_with_the_rank(tmp_path, caplog):
    """A program that calls runner.load() itself gets the lines `aot run` prints from the `aot` logger
    (runner/execution/log.py): warnings at WARNING, each record with its rank; several ranks' lines say which."""
    import logging

    import runner
    from runner.execution.log import RankLogger

    art = tmp_path / "dgx1"
    ok(aot("build", REPO / "examples" / "mlp.py", "--topology", "dgx_a100", "--world-size", "1", "-o", art, "--quiet", "--no-onnx"))
    with caplog.at_level(logging.INFO, logger="aot"):
        trainer = runner.load(art, rank=0, world_size=1, device="cpu", allow_topology_mismatch=True)
    records = [r for r in caplog.records if r.name == "aot"]
    assert records and all(r.rank == 0 for r in records)
    assert records[0].levelno == logging.WARNING
    assert records[0].getMessage().startswith("running on hardware that differs from the artifact's topology profile 'dgx_a100'")
    assert "topology mismatch: GPU count: profile 'dgx_a100' expects 8 GPUs per node" in records[1].getMessage()
    inputs, targets = trainer.data_source().batch(0)
    assert torch.isfinite(torch.tensor(trainer.step(inputs, targets)))

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aot"):
        RankLogger(3, 4).warning("a line")
    assert [(r.getMessage(), r.rank) for r in caplog.records] == [("[rank 3] a line", 3)]
