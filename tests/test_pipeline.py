"""Pipeline parallelism (aot/plan/pipeline.py, aot/capture/pipeline.py, aot/pipeline_build.py).

Schedules in process: every rank runs each microbatch's forward and backward once, a forward
before its backward, and replaying them as the ranks would never deadlocks. Built programs: every
send has its receive on the peer's program (same tag, shape and dtype), and on each rank a
microbatch's forward transfer precedes its backward one. Under torchrun: training equals eager DDP
over the same global batch (gpt.py's tied embedding included), checkpoints merge across stages.
"""

from __future__ import annotations

import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aot.errors import AotError
from aot.plan.pipeline import SCHEDULES, balance, bubble_floor, bubble_fraction, check, schedule_actions, unit_step
from aot.plan.pipeline_floor import busiest_share, rank_holdings
from helpers.commands import EXAMPLES, MODELS, aot, ok, show
from helpers.training import TOL, adamw_lr, assert_same_training, train_both
from runner.format.program import decode_program

P2P = {"isend", "irecv"}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp,microbatches", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 6)])
def test_schedules_run_every_microbatch_once_forward_first_without_deadlock(schedule, pp, microbatches):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    actions = schedule_actions(schedule, pp, microbatches, virtual)
    check(actions, microbatches, virtual)
    for rank in actions:
        position = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(rank)}
        assert all(position[("F", mb, c)] < position[("B", mb, c)] for mb in range(microbatches) for c in range(virtual))
        if schedule == "zero-bubble":  # a microbatch's weight gradients after its input gradients
            assert all(position[("B", mb, 0)] < position[("W", mb, 0)] for mb in range(microbatches))
    if schedule == "1f1b":  # at most pp - r microbatches in flight on rank r: what bounds its activations
        for r, rank in enumerate(actions):
            in_flight = peak = 0
            for a in rank:
                in_flight += 1 if a.kind == "F" else -1
                peak = max(peak, in_flight)
            assert peak == min(pp - r, microbatches)


def test_a_schedule_that_deadlocks_or_misses_an_action_is_refused():
    gpipe = schedule_actions("gpipe", 2, 2)
    swapped = [gpipe[0], [gpipe[1][2], gpipe[1][3], gpipe[1][0], gpipe[1][1]]]  # rank 1: backwards first
    with pytest.raises(AotError, match="deadlocks"):
        check(swapped, 2)
    with pytest.raises(AotError, match="each microbatch's forward and backward once"):
        check([gpipe[0], gpipe[1][:-1]], 2)


def test_zero_bubble_fills_1f1bs_waits_with_weight_gradients_holding_no_more_microbatches():
    """With forward, input-gradient and weight-gradient passes of one unit each (1F1B's backward:
    two), zero-bubble's step at pp=4 and 8 microbatches is 29 units against 1F1B's 33 (24 of
    work): its idle time 5 units per rank against 9; no rank holds more than pp microbatches
    between a forward and its W, the most 1F1B's first rank holds."""
    zb, one = schedule_actions("zero-bubble", 4, 8), schedule_actions("1f1b", 4, 8)
    assert unit_step(one) == 33 and unit_step(zb) == 29
    assert bubble_fraction("zero-bubble", 4, 8) == pytest.approx(5 / 29) and bubble_fraction("1f1b", 4, 8) == pytest.approx(9 / 33)
    for rank in zb:
        held = peak = 0
        for a in rank:
            held += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, held)
        assert peak <= 4
    with pytest.raises(AotError, match="forward, backward and weight gradient once"):
        check([zb[0], [a for a in zb[1] if str(a) != "W3"], *zb[2:]], 8)


def test_bubble_and_balance():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    # the planner's bound never exceeds a schedule's share (zero-bubble's simulated from its orders)
    for schedule, pp, m in [("zero-bubble", p, m) for p in (2, 3, 4, 8) for m in (p, p + 1, 2 * p, 4 * p + 3)] + [("1f1b", 4, 8)]:
        assert bubble_floor(schedule, pp, m) <= bubble_fraction(schedule, pp, m) + 1e-12
    assert bubble_floor("zero-bubble", 2, 8) == pytest.approx(1 / 25) == bubble_fraction("zero-bubble", 2, 8)  # pp=2: the bound is the share
    assert balance([1, 1, 1, 1], 2) == [2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1]  # the costly first layer alone
    with pytest.raises(AotError, match="cannot cut 2 layer"):
        balance([1, 1], 3)


def test_the_busiest_ranks_share_is_the_least_over_every_split():
    """aot.plan.pipeline_floor.busiest_share: the least, over every stage split, of the most any
    rank holds at the start of one of its actions, per byte of gradient. Checked by brute force
    over splits on a grid (pp=2, one and two stages per rank): no split holds less (a floor) and
    the best split holds it (exact). 1F1B at pp=2 with 2 microbatches: the sums alone give 1/2;
    the last rank runs its second forward after its first backward, so with the gathered
    parameters read by forwards 2/3; read until each stage's last backward, every rank holds all of
    its sums and gathered parameters at its last backward: the whole of it."""
    one = schedule_actions("1f1b", 2, 2)
    assert busiest_share(one, None, 0.0) == pytest.approx(1 / 2)
    assert busiest_share(one, "forward", 0.0) == pytest.approx(2 / 3)
    assert busiest_share(one, "backward", 0.0) == pytest.approx(1.0)
    grid = [i / 40 for i in range(41)]
    for schedule, m, virtual in [("1f1b", 2, 1), ("1f1b", 4, 1), ("zero-bubble", 2, 1), ("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 4, 2)]:
        actions = schedule_actions(schedule, 2, m, virtual)
        stages = 2 * virtual
        splits = [x for x in itertools.product(grid, repeat=stages - 1) if sum(x) <= 1 + 1e-9]
        for gathered in (None, "forward", "backward"):
            share = busiest_share(actions, gathered, 0.25)
            most = []
            for x in splits:
                fractions = [*x, 1 - sum(x)]  # stage c * pp + r holds fractions[c * 2 + r]
                most.append(max(sum(h[c] * fractions[c * 2 + r] for c in range(virtual)) for r in range(2) for h in rank_holdings(actions[r], gathered, 0.25)))
            assert min(most) >= share - 1e-9, (schedule, m, gathered)
            assert min(most) <= share + 0.03, (schedule, m, gathered, min(most), share)


def _transfers(program_file: Path) -> list[tuple]:
    """(op, peer, tag, shape, dtype) of every p2p node of a built program, in program order."""
    ep = decode_program(program_file.read_bytes(), None)
    found = []
    for node in ep.graph.nodes:
        name = getattr(node.target, "_schema", None) and node.target._schema.name.split("::")[-1]
        if node.op == "call_function" and name in P2P:
            val = node.args[0].meta["val"]
            found.append((name, node.args[1], node.args[2], tuple(val.shape), val.dtype))
    return found


@pytest.mark.parametrize("model,schedule", [("mlp.py", "interleaved-1f1b"), ("gpt.py", "1f1b"), ("gpt.py", "zero-bubble")])
def test_built_programs_pair_every_send_with_a_receive(tmp_path, model, schedule):
    art = tmp_path / "art"
    ok(
        aot(
            "build",
            EXAMPLES / model,
            "--strategy",
            "pp=2",
            "--pp-schedule",
            schedule,
            "--microbatches",
            4,
            "--batch-size",
            8,
            "--no-onnx",
            "-o",
            art,
            "--quiet",
        )
    )
    manifest = json.loads((art / "manifest.json").read_text())
    pipeline = manifest["pipeline"]
    assert pipeline["schedule"] == schedule and pipeline["microbatches"] == 4 and pipeline["microbatch_size"] == 2
    assert [r["program"] for r in manifest["ranks"]] == ["train.pp0", "train.pp1"]
    stages = pipeline["stages"]
    assert len(stages) == (4 if schedule == "interleaved-1f1b" else 2)
    held = [set(p for s in stages if s["rank"] == r for p in s["params"]) for r in (0, 1)]
    assert held[0] | held[1] == set(manifest["state"]["params"])
    assert held[0] & held[1] == set(pipeline["tied"]) == ({"tok_emb.weight"} if model == "gpt.py" else set())
    transfers = {r: _transfers(art / manifest["programs"][f"train.pp{r}"]["file"]) for r in (0, 1)}
    for r, peer in ((0, 1), (1, 0)):
        sends = sorted((tag, shape, dtype) for op, p, tag, shape, dtype in transfers[r] if op == "isend" and p == peer)
        receives = sorted((tag, shape, dtype) for op, p, tag, shape, dtype in transfers[peer] if op == "irecv" and p == r)
        assert sends and sends == receives
    for r in (0, 1):  # a microbatch's activation leaves or arrives before its gradient does
        order = [tag for _, _, tag, _, _ in transfers[r]]
        for tag in order:
            if tag % 2 == 0 and tag + 1 in order:
                assert order.index(tag) < order.index(tag + 1)
    text = ok(aot("inspect", art)).stdout
    assert f"pipeline   pp=2 {schedule}, 4 microbatches of 2" in text
    # the predicted step: both programs simulated side by side, one trace thread per pipeline rank
    predicted, programs = manifest["time"]["predicted"], pipeline["programs"]
    busy = [programs[f"train.pp{r}"]["busy_s"] for r in (0, 1)]
    assert predicted["step_s"] == pytest.approx(max(busy) + predicted["bubble_s"])
    assert all(b + programs[f"train.pp{r}"]["waiting_s"] == pytest.approx(predicted["step_s"]) for r, b in enumerate(busy))
    assert 0.3 * pipeline["predicted_bubble"] < predicted["bubble_s"] / predicted["step_s"] < 3 * pipeline["predicted_bubble"]
    trace = json.loads((art / pipeline["timeline"]).read_text())
    assert pipeline["timeline"] in manifest["files"]
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}


GPT4 = "../tests/models/gpt4.py"  # gpt.py with 4 blocks (relative to examples/)
CASES = [
    ("mlp.py", "pp=2", ()),
    ("gpt.py", "pp=2", ()),
    (GPT4, "pp=2", ("--pp-schedule", "interleaved-1f1b", "--microbatches", 4)),
    ("gpt.py", "pp=2", ("--pp-schedule", "zero-bubble", "--microbatches", 4)),
]
SLOW_CASES = [
    ("gpt.py", "pp=2,fsdp=2", ("--pp-schedule", "zero-bubble", "--microbatches", 4)),
    ("gpt.py", "pp=2,dp=2", ()),
    ("gpt.py", "pp=2,fsdp=2", ()),
    ("gpt.py", "pp=2,tp=2", ()),
    ("gpt.py", "pp=2,tp=2", ("--sequence-parallel",)),
    (GPT4, "pp=2,tp=2", ("--sequence-parallel", "--pp-schedule", "interleaved-1f1b", "--microbatches", 4)),
    ("mlp.py", "pp=2", ("--pp-schedule", "gpipe", "--microbatches", 4)),
]


@pytest.mark.parametrize("model,strategy,args", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_pipeline_training_matches_eager_ddp(tmp_path, model, strategy, args):
    world = 4 if "," in strategy else 2
    losses, ref_losses, weights, ref_weights = train_both(EXAMPLES / model, world, tmp_path, strategy=strategy, build_args=args)
    # tensor parallelism's bound for gpt.py (tests/test_train_matches_ddp.py): its split matmuls sum in another order
    if "tp" in strategy:
        assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(EXAMPLES / "gpt.py"))
    else:
        assert_same_training(losses, ref_losses, weights, ref_weights)


@pytest.mark.slow  # 4 builds and 2 torchruns (about 55 s); CI runs it
def test_recomputing_stages_matches_eager_ddp_and_lowers_the_peak(built, tmp_path):
    """`--activation-budget 0` with pp: every stage's forward runs again inside its backward
    (torch.utils.checkpoint in the trace), so 1F1B's in-flight microbatches hold their inputs only.
    The numbers are eager DDP's; the predicted peak is below the same build's without; a stage that
    draws random numbers (dropout) and a memory budget under the smallest peak are refused."""
    args = ("--microbatches", 4, "--batch-size", 8)
    gpt4 = (MODELS / "gpt4.py", "--world-size", 2, "--strategy", "pp=2", *args, "--no-onnx")
    with ThreadPoolExecutor(2) as pool:  # the four builds two at a time; the recomputing one is train_both's below
        trained = pool.submit(built, *gpt4, "--activation-budget", 0)
        plain, tight, dropout = pool.map(
            lambda command: aot(*command),
            [
                ("build", *gpt4, "--quiet", "-o", tmp_path / "plain"),
                ("build", *gpt4, "--memory-budget", "1MiB", "-o", tmp_path / "x"),
                ("build", MODELS / "gpt_dropout.py", "--world-size", 2, "--strategy", "pp=2", "--no-onnx", "--activation-budget", 0, "-o", tmp_path / "y"),
            ],
        )
        trained.result()
    ok(plain)
    losses, ref_losses, weights, ref_weights = train_both(
        MODELS / "gpt4.py", 2, tmp_path, strategy="pp=2", batch_size=8, build_args=("--microbatches", 4, "--activation-budget", 0)
    )
    assert_same_training(losses, ref_losses, weights, ref_weights)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    without = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert manifest["memory"]["recompute"]["policy"] == "stages"
    assert manifest["memory"]["predicted"]["peak"] < 0.85 * without["memory"]["predicted"]["peak"]
    refusal = "aot: error: --memory-budget 1.0 MiB: with pp the smallest predicted peak is "
    assert tight.returncode == 1 and tight.stderr.strip().splitlines()[-1].startswith(refusal), show(tight)
    assert dropout.returncode == 1 and "draws random numbers (bernoulli_, dropout?)" in dropout.stderr.strip().splitlines()[-1], show(dropout)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert "recompute  every stage's forward again in its backward" in ok(aot("inspect", tmp_path / "art")).stdout


def test_stages_move_off_the_compute_balance_to_fit_device_memory(tmp_path):
    """1F1B's first rank holds more microbatches in flight than the last: mlp.py's compute balance
    (layers 0..3 | 4) peaks on rank 0. On GPUs one byte too small for that peak (after headroom)
    the build moves the boundary toward the last stage until every rank fits, without recomputing,
    and trains exactly as eager DDP."""
    from aot.plan.search import MEMORY_HEADROOM
    from runner.hardware.topology import load_profile

    args = ("--world-size", 2, "--strategy", "pp=2", "--microbatches", 4, "--batch-size", 8, "--no-onnx")
    ok(aot("build", EXAMPLES / "mlp.py", *args, "--topology", "dgx_a100", "--quiet", "-o", tmp_path / "roomy"))
    roomy = json.loads((tmp_path / "roomy" / "manifest.json").read_text())
    highest = roomy["memory"]["predicted"]["peak"]
    profile = load_profile("dgx_a100")
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int((highest - 1) / MEMORY_HEADROOM)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(profile))
    build = ("--microbatches", 4, "--topology", path)
    losses, ref_losses, weights, ref_weights = train_both(
        EXAMPLES / "mlp.py", 2, tmp_path, strategy="pp=2", batch_size=8, build_args=build, run_args=("--allow-topology-mismatch",)
    )
    assert_same_training(losses, ref_losses, weights, ref_weights)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    layers = lambda m: [s["layers"] for s in m["pipeline"]["stages"]]  # noqa: E731
    assert layers(roomy) == [["0", "1", "2", "3"], ["4"]] and len(layers(manifest)[0]) < 4, layers(manifest)
    assert manifest["memory"]["recompute"]["policy"] == "none"
    assert manifest["memory"]["predicted"]["peak"] <= MEMORY_HEADROOM * profile["node"]["gpus"][next(iter(profile["node"]["gpus"]))]["memory_bytes"] < highest


def test_interleaved_stages_move_off_the_compute_balance_to_fit_device_memory(tmp_path):
    """Interleaved (4 stages on 2 ranks, stage s on rank s % 2): mlp.py's compute balance
    (0 | 1 | 2, 3 | 4) peaks on rank 0, which holds stages 0 and 2. One byte too little memory
    for that peak: the build hands a layer of rank 0's stages to a neighbouring stage of rank 1,
    and every rank's predicted peak fits, without recomputing."""
    from aot.plan.search import MEMORY_HEADROOM
    from runner.hardware.topology import load_profile

    args = ("--world-size", 2, "--strategy", "pp=2", "--microbatches", 4, "--batch-size", 8, "--pp-schedule", "interleaved-1f1b", "--no-onnx", "--quiet")
    ok(aot("build", EXAMPLES / "mlp.py", *args, "--topology", "dgx_a100", "-o", tmp_path / "roomy"))
    roomy = json.loads((tmp_path / "roomy" / "manifest.json").read_text())
    highest = roomy["memory"]["predicted"]["peak"]
    profile = load_profile("dgx_a100")
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int((highest - 1) / MEMORY_HEADROOM)
    (tmp_path / "small.json").write_text(json.dumps(profile))
    ok(aot("build", EXAMPLES / "mlp.py", *args, "--topology", tmp_path / "small.json", "-o", tmp_path / "art"))
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    layers = lambda m: [s["layers"] for s in m["pipeline"]["stages"]]  # noqa: E731
    peaks = lambda m: [p["peak_bytes"] for p in m["pipeline"]["programs"].values()]  # noqa: E731
    assert layers(roomy) == [["0"], ["1"], ["2", "3"], ["4"]] and max(peaks(roomy)) == peaks(roomy)[0] == highest
    assert layers(manifest) != layers(roomy) and [s["rank"] for s in manifest["pipeline"]["stages"]] == [0, 1, 0, 1]
    assert manifest["memory"]["recompute"]["policy"] == "none"
    limit = MEMORY_HEADROOM * next(iter(profile["node"]["gpus"].values()))["memory_bytes"]
    assert max(peaks(manifest)) == manifest["memory"]["predicted"]["peak"] <= limit < highest


def test_an_8_rank_pipeline_of_fsdp_and_tensor_parallel_stages_builds_and_inspects(tmp_path):
    """pp=2,fsdp=2,tp=2: two programs, each rank's pipeline stage, fsdp shard and tp slice."""
    art = tmp_path / "art"
    ok(aot("build", EXAMPLES / "gpt.py", "--world-size", 8, "--strategy", "pp=2,fsdp=2,tp=2", "--batch-size", 4, "--no-onnx", "-o", art, "--quiet"))
    summary = json.loads(ok(aot("inspect", art, "--json")).stdout)
    assert summary["mesh"] == {"axes": ["pp", "fsdp", "tp"], "shape": [2, 2, 2]}
    assert [r["program"] for r in summary["ranks"]] == ["train.pp0"] * 4 + ["train.pp1"] * 4
    assert sorted(r["state_shard"] for r in summary["ranks"]) == list(range(8))
    for name, program in summary["programs"].items():
        groups = {c["group"] for c in program["collectives"]}
        assert {"aot.fsdp", "aot.tp", "aot.pp"} <= groups, (name, groups)
    # a stage's ranks hold its parameters only (each its fsdp shard of its tp slice): alike within a
    # stage, and each well under half the model (the tied embedding, 4,160 of its elements, is on both stages)
    per_rank = [r["parameters"] for r in summary["ranks"]]
    total = sum(math.prod(shape) for shape, _ in json.loads((art / "manifest.json").read_text())["state"]["params"].values())
    assert len(set(per_rank[:4])) == 1 and len(set(per_rank[4:])) == 1
    assert all(count < total / 3 for count in per_rank), (per_rank, total)
    text = ok(aot("inspect", art)).stdout
    assert "pipeline   pp=2 1f1b" in text and "tensor parallel over 2 ranks (aot.tp)" in text


def test_pipeline_resume_is_exact_and_verify_passes(built, tmp_path):
    """gpt.py at pp=2: 3 steps straight == 1 step, save, resume, 2 steps, bit for bit, in every
    stage's shard; `aot verify` runs both stages beside eager DDP."""
    import torch
    from safetensors.torch import load_file

    from helpers.commands import torchrun

    art = built(EXAMPLES / "gpt.py", "--strategy", "pp=2", "--batch-size", 4, "--no-onnx")  # as the training test's
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    ok(torchrun(2, "run", art, "--steps", "3", "--save", full, "--quiet"))
    ok(torchrun(2, "run", art, "--steps", "1", "--save", first, "--quiet"))
    ok(torchrun(2, "run", art, "--steps", "2", "--resume", first, "--save", resumed, "--quiet"))
    a, b = json.loads((full / "checkpoint.json").read_text()), json.loads((resumed / "checkpoint.json").read_text())
    assert len(a["shards"]) == 2 and a["shards"] == b["shards"] and a["pipeline"] == {"axis": "pp", "size": 2}
    stage_keys = []
    for shard in a["shards"]:
        for role, name in shard.items():
            x, y = load_file(full / name), load_file(resumed / name)
            assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
            if role == "weights":
                stage_keys.append(set(x))
    assert stage_keys[0] & stage_keys[1] == {"tok_emb.weight"}  # the tied weight, on both ends
    r = ok(aot("verify", art, EXAMPLES / "gpt.py", "--steps", 2))
    assert ": OK" in r.stdout + r.stderr


def test_fp16_loss_scaling_through_the_pipeline_matches_grad_scaler(tmp_path):
    """fp16_overflow.py at pp=2: found_inf is summed over the stages, so both skip the same steps,
    and the scale sequence is eager GradScaler's over the whole batch. Losses and weights within
    the mixed-precision bounds (tests/test_mixed_precision.py), losses a little wider: the
    gradients are summed over 2 microbatches in fp16 where eager sums the batch in one matmul."""
    from safetensors.torch import load_file

    from helpers.commands import MODELS, torchrun
    from helpers.training import reference
    from runner.format.checkpoint import merge_checkpoint

    art, ckpt, metrics = tmp_path / "art", tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    ok(aot("build", MODELS / "fp16_overflow.py", "--strategy", "pp=2", "--batch-size", 4, "-o", art, "--quiet", "--no-onnx", "--topology", "cpu"))
    ok(torchrun(2, "run", art, "--steps", 8, "--metrics", metrics, "--save", ckpt, "--quiet"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    ref = reference(
        MODELS / "fp16_overflow.py",
        art / "data" / "example_batch.safetensors",
        1,
        4,
        tmp_path,
        extra_args=["--precision", "fp16", "--param-dtype", "fp16"],
        steps=8,
    )
    eager = json.loads((ref / "scaler.json").read_text())
    assert [r["loss_scale"] for r in records] == eager["scales"]
    assert [r["skipped"] for r in records] == eager["skipped"] and any(eager["skipped"])
    losses, ref_losses = [r["loss"] for r in records], json.loads((ref / "losses.json").read_text())
    assert abs(losses[0] - ref_losses[0]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-3, (losses, ref_losses)
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    weights, ref_weights = load_file(tmp_path / "merged.safetensors"), load_file(ref / "state_dict.safetensors")
    diffs = {k: (weights[k].double() - ref_weights[k].double()).abs() for k in ref_weights}
    assert max(d.max().item() for d in diffs.values()) <= 1e-2
    assert sum(d.sum().item() for d in diffs.values()) / sum(d.numel() for d in diffs.values()) <= 1e-5


def test_stage_transfers_are_priced_by_the_calibrated_point_to_point_line(tmp_path):
    """The predicted pipeline step prices each stage transfer with the profile's calibrated
    `send_recv` line (aot topology calibrate measures it): at 1F1B with 2 microbatches on 2 ranks
    the last stage cannot start before the first activation arrives and the first stage cannot
    finish before the last gradient does, so at 50 ms per transfer the step takes at least 2 x 50 ms
    (a millisecond at the profile's default loopback latency)."""
    from runner.hardware.topology import load_profile

    profile = load_profile("cpu")
    profile["calibration"] = {"loopback": {"alpha_s": 30e-6, "beta_s_per_byte": 5e-10, "per_kind": {"send_recv": {"alpha_s": 0.05, "beta_s_per_byte": 0.0}}}}
    (tmp_path / "slow_p2p.json").write_text(json.dumps(profile))
    args = ("--world-size", 2, "--strategy", "pp=2", "--microbatches", 2, "--batch-size", 8, "--no-onnx", "--quiet")
    steps = {}
    for topology in ("cpu", tmp_path / "slow_p2p.json"):
        art = tmp_path / ("fast" if topology == "cpu" else "slow")
        ok(aot("build", EXAMPLES / "mlp.py", *args, "--topology", topology, "-o", art))
        steps[art.name] = json.loads((art / "manifest.json").read_text())["time"]["predicted"]["step_s"]
    assert steps["slow"] >= 2 * 0.05 > 20 * steps["fast"], steps


def test_pipeline_waits_pay_the_calibrated_in_step_stall_on_cpu_ranks(tmp_path):
    """On CPU ranks a blocking wait for another rank costs the calibrated in-step stall (a
    scheduler tick, often), as a data-parallel step's collectives do (aot.plan.cost_model): the
    simulated pipeline charges it at each receive and the pipeline all_reduce. At 1F1B with 2
    microbatches on 2 ranks the first rank waits for both gradients before its last backward, so a
    10 ms stall adds at least 20 ms."""
    from runner.hardware.topology import load_profile

    profile = load_profile("cpu")
    profile["compute"] = {"collective_stall_s": 0.01}
    (tmp_path / "stalling.json").write_text(json.dumps(profile))
    args = ("--world-size", 2, "--strategy", "pp=2", "--microbatches", 2, "--batch-size", 8, "--no-onnx", "--quiet")
    steps, busy = {}, {}
    for topology in ("cpu", tmp_path / "stalling.json"):
        art = tmp_path / ("plain" if topology == "cpu" else "stalling")
        ok(aot("build", EXAMPLES / "mlp.py", *args, "--topology", topology, "-o", art))
        manifest = json.loads((art / "manifest.json").read_text())
        steps[art.name] = manifest["time"]["predicted"]["step_s"]
        busy[art.name] = max(p["busy_s"] for p in manifest["pipeline"]["programs"].values())
    assert steps["stalling"] >= steps["plain"] + 2 * 0.01, steps
    assert busy["stalling"] == pytest.approx(busy["plain"], rel=0.05)  # the stall is waiting, not work


def test_plan_prices_pipeline_meshes_as_the_build_predicts_them(tmp_path):
    """`aot plan --axes dp,pp`: a pipeline plan's step and memory are the build's prediction for the
    same mesh and microbatches (the same programs, simulated side by side)."""
    r = ok(aot("plan", EXAMPLES / "mlp.py", "--topology", "cpu", "--world-size", 2, "--batch-size", 8, "--axes", "dp,pp", "--json"))
    plans = json.loads(r.stdout)["plans"]
    pipeline = next(p for p in plans if p["strategy"] == "pp=2")
    assert pipeline["pipeline"]["schedule"] == "zero-bubble" and pipeline["pipeline"]["microbatches"] in (2, 4, 8)
    assert any(p["strategy"] == "dp=2" for p in plans)
    art = tmp_path / "art"
    ok(
        aot(
            "build",
            EXAMPLES / "mlp.py",
            "--topology",
            "cpu",
            "--strategy",
            "pp=2",
            "--batch-size",
            8,
            "--no-onnx",
            "--microbatches",
            pipeline["pipeline"]["microbatches"],
            "--pp-schedule",
            pipeline["pipeline"]["schedule"],
            "--stages-per-rank",
            pipeline["pipeline"]["stages_per_rank"],
            "-o",
            art,
            "--quiet",
        )
    )
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["time"]["predicted"]["step_s"] == pytest.approx(pipeline["step_s"])
    assert manifest["memory"]["predicted"]["peak"] == pipeline["memory_bytes"]["peak"]


def test_transfer_tags_name_their_transfer_and_refuse_what_they_cannot_hold():
    """The format's p2p tags (runner/format/transfers.py): each decodes to the transfer it was made
    for (what a stuck pipeline's one line names), and a stage or output beyond the tag's room is
    refused rather than shared."""
    from runner.errors import AotError
    from runner.format.transfers import Transfer, transfer_tag

    for fields in [(0, 0, 1, 0, False), (5, 1, 0, 2, True), (4095, 63, 62, 63, True)]:
        assert Transfer.of_tag(transfer_tag(*fields)) == Transfer(*fields)
    assert Transfer(2, 0, 1, 0, True).describe() == "microbatch 2's gradient from stage 1 to stage 0"
    with pytest.raises(AotError, match="at most 64 stages"):
        transfer_tag(0, 64, 1, 0, False)
