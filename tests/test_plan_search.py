"""Strategy search end to end: `aot plan`, `aot build --strategy auto` and `aot topology calibrate`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from aot.cli import cli
from aot.plan.machine import Machine
from aot.plan.mesh import factorizations
from aot.plan.pipeline import schedule_actions
from aot.plan.pipeline_floor import busiest_floor
from runner.format.artifact import Artifact
from runner.hardware.topology import load_profile

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "examples" / "mlp.py")
GPT = str(REPO / "examples" / "gpt.py")
# examples/mlp.py: 32*64 + 64 + 64*64 + 64 + 64*10 + 10 = 6922 float32 parameters
MLP_PARAM_BYTES = 6922 * 4
# fsdp=2 shards, each padded to an even length: 1024 + 32 + 2048 + 32 + 320 + 5 elements
MLP_SHARD_BYTES = 3461 * 4


def _plan(*args) -> dict:
    result = CliRunner().invoke(cli, ["plan", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_planning_says_what_it_traces_as_it_starts():
    """Each trace and each pipeline's programs announced (`aot plan` prints them on a terminal):
    the layout classes of 8 ranks over dp, fsdp and tp (the graphs without fsdp derived; the
    longest first, aot/plan/layout_traces.py), the meshes' pricing as it goes, and a pipeline's
    programs for each schedule and microbatch count traced."""
    from aot.plan.search import plan_model
    from runner.hardware.topology import for_nodes, load_profile

    said: list[str] = []
    profile = for_nodes(load_profile("dgx_a100"), 1, 8)
    plan_model(Path(MLP), profile, 8, 8, axes=("dp", "fsdp", "tp"), note=said.append)
    assert said == [
        # each class's meshes priced as soon as it is traced (8 ranks: 4 + 3 + 2 + 1 meshes)
        "tracing the step on dp x fsdp=2 (1 of 4), 1 more graph(s) derived from it, then pricing the 4 meshes read from them",
        "tracing the step on dp x fsdp=2 x tp=2 (2 of 4), 1 more graph(s) derived from it, then pricing the 3 meshes read from them",
        "tracing the step on fsdp=2 x tp=4 (3 of 4), 1 more graph(s) derived from it, then pricing the 2 meshes read from them",
        "tracing the step on tp=8 (4 of 4), then pricing the 1 mesh read from it",
    ], said
    said.clear()
    # a mesh refused before any trace (tp=16 would span two nodes) is not announced as priced
    _, skipped, _, _ = plan_model(Path(MLP), for_nodes(load_profile("dgx_a100"), 2, 16), 16, 8, axes=("fsdp", "tp"), note=said.append)
    assert any(line.startswith("tp=16: ") for line in skipped) and all(line.startswith("tracing the step on ") for line in said), (said, skipped)
    said.clear()
    # meshes left to price after the traces (a what-if plan on another profile reuses the graphs
    # traced for the first): a line as that starts, and one at each quarter of them
    steps = plan_model(Path(MLP), profile, 8, 8, axes=("dp", "fsdp", "tp"))[3]
    plan_model(Path(MLP), profile, 8, 8, axes=("dp", "fsdp", "tp"), note=said.append, reuse=steps)
    assert said == [
        "pricing 10 meshes without pp, each at every bucket size (recomputing activations where over device memory)",
        "pricing mesh 3 of 10 (fsdp=4,tp=2)",
        "pricing mesh 6 of 10 (dp=2,fsdp=2,tp=2)",
        "pricing mesh 8 of 10 (dp=4,tp=2)",
    ], said
    said.clear()
    plan_model(Path(MLP), for_nodes(load_profile("dgx_a100"), 1, 2), 2, 8, axes=("pp",), note=said.append)
    assert said[0] == "tracing every pipeline rank's program of pp=2 (interleaved-1f1b, 2 stages per rank, 2 microbatches)", said
    assert all(line.startswith("tracing every pipeline rank's program of pp=2 (") for line in said), said
    # a configuration the batch cannot take is refused before any tracing, and not announced
    from aot.plan.model_steps import ModelSteps, Unsupported

    said.clear()
    steps = ModelSteps(Path(MLP), 2, note=said.append)
    with pytest.raises(Unsupported, match="does not split into"):
        steps.pipeline(("pp",), (2,), steps.targets.shape[0] + 1, "1f1b")
    assert said == [], said


def test_pipeline_configurations_that_cannot_beat_a_priced_one_are_not_traced():
    """A pipeline mesh's configurations are tried in the order of a lower bound on their time per
    sample (their ops at m microbatches shared by every rank, idle at least the schedule's bubble
    floor: PipelineSearch._configurations), and one whose bound is above a configuration priced
    that fits is not traced. The mesh's plan is the one pricing all nine finds (mlp.py, pp=2 of 2
    A100s, a batch of 8: three traced, each microbatch's ops costing at least the GPU's launch
    overhead, so that 4 and 8 microbatches cannot be faster)."""
    from aot.plan.search import plan_model
    from runner.hardware.topology import for_nodes, load_profile

    said: list[str] = []
    plans, _, planner, _ = plan_model(Path(MLP), for_nodes(load_profile("dgx_a100"), 1, 2), 2, 8, axes=("pp",), note=said.append)
    assert [line.split("(")[1] for line in said] == [
        "interleaved-1f1b, 2 stages per rank, 2 microbatches)",
        "1f1b, 2 microbatches)",
        "zero-bubble, 2 microbatches)",
    ], said
    pruned = next(p for p in plans if p.shape == (2,))
    planner._work = None  # no bounds: every configuration priced, in the order 1F1B, interleaved, zero-bubble
    every = planner.pipeline_plan(("pp",), (2,))
    assert len(said) == 9
    assert (every.prediction, every.pipeline, every.fits) == (pruned.prediction, pruned.pipeline, pruned.fits)


def test_factorizations_cover_every_mesh():
    assert factorizations(8, ("dp", "fsdp")) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert factorizations(1, ("dp",)) == [(1,)]
    assert len(factorizations(1024, ("dp", "fsdp"))) == 11


def test_plan_ranks_data_parallel_and_fsdp_candidates_on_cpu_ranks():
    out = _plan(MLP, "--topology", "cpu", "--world-size", "2", "--axes", "dp,fsdp,tp")
    plans = out["plans"]
    assert out["world_size"] == 2 and out["parameters"] == 6922 and not out["calibrated"]
    # where planning's time went: its parts add up to the whole, tracing the step took some
    spent = out["time"]
    assert set(spent) == {"total_s", "recording_s", "tracing_s", "recomputing_s", "pipeline_programs_s", "pricing_s"}
    assert spent["tracing_s"] > 0 and spent["pipeline_programs_s"] == 0
    assert abs(sum(v for k, v in spent.items() if k != "total_s") - spent["total_s"]) < 0.01
    assert {p["strategy"] for p in plans} == {"dp=2", "fsdp=2", "tp=2"}
    per_sample = [p["step_s"] / p["data_ranks"] for p in plans]
    assert per_sample == sorted(per_sample) and all(p["fits"] for p in plans)  # a cpu profile has no memory limit
    dp = next(p for p in plans if p["strategy"] == "dp=2" and p["bucket_mb"] == 25.0)
    # one bucket: every gradient and the 4-byte loss
    assert dp["collectives_per_step"] == 1 and dp["collective_bytes_per_step"] == MLP_PARAM_BYTES + 4
    assert dp["memory_bytes"]["params"] == MLP_PARAM_BYTES and dp["memory_bytes"]["optimizer"] == MLP_PARAM_BYTES
    fsdp = next(p for p in plans if p["strategy"] == "fsdp=2")
    assert fsdp["memory_bytes"]["params"] == MLP_SHARD_BYTES
    # 6 all_gathers (n = the padded whole parameter), 6 reduce_scatters, the loss's all_reduce, and
    # the weights of layers 1 and 2 (64x64, 10x64) gathered again for backward, as the build does
    assert fsdp["algorithms"] == {"all_gather:ring": 8, "all_reduce:ring": 1, "reduce_scatter:ring": 6}
    assert fsdp["collective_bytes_per_step"] == 2 * 2 * MLP_SHARD_BYTES + 4 + (64 * 64 + 10 * 64) * 4
    # tp=2: layer 0 column-wise (half its weight and bias), layer 2 row-wise (half its weight),
    # the last layer whole; one all_reduce of layer 2's output (batch 8 x 64) and nothing backward,
    # since the input needs no gradient
    tp = next(p for p in plans if p["strategy"] == "tp=2")
    assert tp["memory_bytes"]["params"] == (32 * 64 // 2 + 64 // 2 + 64 * 64 // 2 + 64 + 64 * 10 + 10) * 4
    assert tp["algorithms"] == {"all_reduce:ring": 1} and tp["collective_bytes_per_step"] == 8 * 64 * 4


def _small_gpus(memory: int) -> dict:
    profile = copy.deepcopy(load_profile("dgx_a100"))
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = memory
    return profile


def test_plans_that_do_not_fit_are_kept_but_never_chosen(tmp_path):
    # 90 kB GPUs (90% usable: 81 kB): dp=2 holds 100 kB per rank, fsdp=2 71 kB
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(_small_gpus(90_000)))
    out = _plan(MLP, "--topology", str(path), "--world-size", "2", "--axes", "dp,fsdp,tp")
    fits = {p["strategy"]: p["fits"] for p in out["plans"]}
    assert fits == {"fsdp=2": True, "tp=2": True, "dp=2": False}
    assert out["plans"][0]["strategy"] in ("fsdp=2", "tp=2")
    path.write_text(json.dumps(_small_gpus(20_000)))
    result = CliRunner().invoke(
        cli, ["build", MLP, "--topology", str(path), "--world-size", "2", "--strategy", "auto", "--no-onnx", "--quiet", "-o", str(tmp_path / "art")]
    )
    assert result.exit_code == 1 and "no plan fits the device memory" in str(result.exception)


def test_plan_for_128_dgx_a100_nodes():
    """dp x fsdp over 1024 ranks: the model traced once (the graph without fsdp derived from it),
    every factorization priced. How long it takes is a benchmark (bench/plan_scale.py,
    BENCHMARKS.md), not a timed test."""
    out = _plan(GPT, "--topology", "dgx_a100", "--nodes", "128", "--axes", "dp,fsdp")
    assert out["world_size"] == 1024 and out["nodes"] == 128
    assert {p["strategy"] for p in out["plans"]} >= {"dp=1024", "fsdp=1024", "dp=128,fsdp=8"}
    best = out["plans"][0]
    assert best["fits"] and any(s.startswith("allreduce:") for s in best["nccl_algo"].split(";")), best["nccl_algo"]


def test_plan_for_128_dgx_a100_nodes_prices_tensor_parallel_within_a_node():
    with_tp = _plan(GPT, "--topology", "dgx_a100", "--nodes", "128")
    strategies = {p["strategy"] for p in with_tp["plans"]}
    assert {"dp=256,tp=4", "dp=512,tp=2"} <= strategies and not any("tp=8" in s for s in strategies)
    skipped = " | ".join(with_tp["skipped"])
    assert "tp=8: --strategy tp=8: the tensor-parallel degree must divide the attention heads" in skipped
    assert "tp=16 would span nodes (8 ranks per node)" in skipped
    assert with_tp["plans"][0]["fits"]


def test_plans_rank_by_time_per_sample_and_price_pipelines_where_they_could_win():
    """--batch-size is per data-parallel rank, so plans rank by seconds per sample: on 2 ranks of a
    DGX A100, tp=2's step is shorter than dp=2's but trains half the samples. Pipeline meshes are
    searched too, and left unpriced, with a line saying why, where a bound shows none can win."""
    out = _plan(GPT, "--topology", "dgx_a100", "--world-size", "2")
    plans = out["plans"]
    per_sample = [p["step_s"] / p["data_ranks"] for p in plans if p["fits"]]
    assert per_sample == sorted(per_sample)
    best = {p["strategy"]: p for p in reversed(plans)}
    assert best["tp=2"]["step_s"] < best["dp=2"]["step_s"] and plans[0]["strategy"] == "dp=2"
    assert not any("pp" in p["strategy"] for p in plans)
    assert any(s.startswith("pp=2 (1 mesh): not priced, none can beat the best plan without pp") for s in out["skipped"]), out["skipped"]


WIDE_MLP = str(REPO / "tests" / "models" / "wide_mlp.py")
LLAMA6 = str(REPO / "tests" / "models" / "llama6.py")


@pytest.mark.parametrize("model, precision", [(WIDE_MLP, "fp32"), (WIDE_MLP, "bf16"), (LLAMA6, "fp32")])
def test_a_pipeline_ranks_floor_is_at_most_its_traced_peak(model, precision):
    """The floor the search prunes pipeline meshes with (Planner.pipeline_cannot_fit): at each
    schedule, microbatch count and recomputation, with and without fsdp, the busiest pipeline
    rank's predicted peak, read from its traced programs, is at least busiest_floor (the summed
    gradients, under fsdp the gathered parameters, the resident shards: aot/plan/pipeline_floor.py)
    and not far above it. The gradients are counted whole, in the dtype they are summed in (the
    gathered parameter's under fsdp with mixed precision, else the parameter's). Where the
    backward reads nearly every weight (llama6: all but the embedding), 1F1B at pp=2 with 2
    microbatches holds every sum and gathered weight at once on both ranks: 1.75 times the
    gradients with Adam's shards beside them, where the sums and shards alone give 1.25."""
    from aot.plan.model_steps import ModelSteps, Pricing

    steps = ModelSteps(Path(model), 4, pricing=Pricing(precision=precision))
    params = sum(p.numel() for p in steps.state.params.values())
    gradients = {fsdp: _gradients(steps, fsdp) for fsdp in (1, 2)}
    assert gradients[1] == 4 * params and gradients[2] == (4 if precision == "fp32" else 2) * params
    configurations = [
        (("pp", "fsdp"), (2, 2), 2, "1f1b", 1, False),
        (("pp", "fsdp"), (2, 2), 2, "zero-bubble", 1, False),
        (("pp", "fsdp"), (2, 2), 4, "1f1b", 1, True),
    ]
    if precision == "fp32" and model == WIDE_MLP:  # the dtype changes under fsdp only: the other schedules once
        configurations += [(("pp",), (2,), 2, "1f1b", 1, False), (("pp",), (2,), 4, "interleaved-1f1b", 2, False)]
    for axes, shape, microbatches, schedule, virtual, recompute in configurations:
        _, analyses = steps.pipeline(axes, shape, microbatches, schedule, virtual, recompute=recompute)
        fsdp = dict(zip(axes, shape)).get("fsdp", 1)
        floor = busiest_floor(steps.pipeline_holdings(fsdp, 1), schedule_actions(schedule, 2, microbatches, virtual))
        busiest = max(a.memory.peak for a in analyses)
        assert gradients[fsdp] / 2 < floor <= busiest <= 3 * floor, (shape, schedule, microbatches, recompute, floor, busiest)
    if model == LLAMA6:
        holdings = steps.pipeline_holdings(2, 1)
        assert holdings.unread == 4 * steps.state.params["embed_tokens.weight"].numel() and holdings.resident == pytest.approx(1.5, abs=1e-3)
        floor = busiest_floor(holdings, schedule_actions("1f1b", 2, 2))
        assert floor == pytest.approx(1.75 * holdings.gradients - holdings.unread, rel=1e-3)


UNUSED_LAYER = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.spare = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))  # `spare` is never called


def model():
    return Model()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 64, generator=g), torch.randn(batch_size, 64, generator=g)


def loss(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)
"""


def test_a_pipeline_floor_counts_the_gradients_the_loss_reaches(tmp_path):
    """The floor's gradients are those of the parameters the loss reaches (a walk of autograd's
    graph from the loss, on the model's fake tensors: aot/capture/backward_reads.py): a layer the
    forward never calls gets none. Of those, the backward reads the second layer's weight (for its
    input's gradient) but neither bias nor the first layer's weight (its input is the batch)."""
    from aot.plan.model_steps import ModelSteps

    path = tmp_path / "unused_layer.py"
    path.write_text(UNUSED_LAYER)
    steps = ModelSteps(path, 2)
    params = steps.state.params
    reached = ["first.weight", "first.bias", "second.weight", "second.bias"]
    holdings = steps.pipeline_holdings(2, 1)
    assert holdings.gradients == 4 * sum(params[n].numel() for n in reached) < _gradients(steps, 2)
    assert holdings.unread == 4 * sum(params[n].numel() for n in ("first.weight", "first.bias", "second.bias"))


@pytest.mark.parametrize("model", ["gpt.py", "llama.py", "moe.py"])
def test_a_pipeline_ranks_held_bytes_are_its_rank_states(model):
    """held_bytes counts from shapes what rank_state's pieces hold, for every parameter and its
    optimizer state: over tp (GPT-2's fused q/k/v), ep (stacked experts), and fsdp degrees that
    pad the flat shards (3)."""
    from aot.capture.step import rank_state
    from aot.plan.model_steps import ModelSteps
    from aot.plan.pipeline_floor import _held_in, held_bytes

    steps = ModelSteps(REPO / "examples" / model, 2)
    layouts = [(1, 1), (2, 1), (3, 1), (1, 2), (3, 2)] + ([(1, 1, 2), (3, 2, 2)] if steps.has_experts else [])
    for fsdp, tp, *ep in layouts:
        sharded = steps.layout(1, fsdp, tp, *ep)
        state = steps.recording(*ep).state
        assert held_bytes(state, sharded) == _held_in(rank_state(state, sharded), state.optimizer_slots), (model, fsdp, tp, ep)


def test_each_pipeline_split_tried_to_fit_device_memory_is_announced():
    """Where a pipeline's balanced stages peak over device memory, each other split captured to
    fit (as long as the first capture) is said as it starts, naming the mesh, the schedule and
    where its stages begin. Where the first move shows the peaks would meet far over the limit
    (llama16 at pp=2: 15.9 and 12.0 MiB, then 14.0 and 13.4, meeting near 13.6 MiB, with 2.9 MiB
    allowed), no other split is tried: the programs are those of the split tried, the lower."""
    from aot.plan.model_steps import ModelSteps, Pricing
    from aot.plan.search import MemoryLimit

    profile = load_profile("dgx_a100")
    said: list[str] = []
    pricing = Pricing(profile, 2, memory_limit=MemoryLimit(3_000_000), compute=Machine(profile, 2).compute)
    steps = ModelSteps(REPO / "tests" / "models" / "llama16.py", 8, pricing=pricing, note=said.append)
    _, analyses = steps.pipeline(("pp",), (2,), 2, "1f1b")
    assert said == [
        "tracing every pipeline rank's program of pp=2 (1f1b, 2 microbatches)",
        "pp=2 (1f1b, 2 microbatches): over device memory (15.9 MiB a rank, 2.9 MiB allowed): trying stages beginning at layers.7",
    ], said
    assert max(a.memory.peak for a in analyses) < 16_675_120  # the balanced split's highest peak


def test_pipeline_meshes_that_cannot_fit_are_not_priced(tmp_path):
    """Where a plan without pp fits, a default search does not trace a pipeline mesh whose busiest
    rank would hold more than the device allows in summed gradients, gathered parameters and
    resident shards alone, whatever its schedule and split (the wide MLP at pp=2,fsdp=4 with 2
    microbatches: 11.7 MiB of its 16 MiB of gradients, their gathered weights and the shards, on
    GPUs with room for 7.2 MiB, where fsdp=8 fits) and says so with the figures; asked for
    pipelines (`--axes`), the search prices them, and none fits."""
    from aot.plan.search import MEMORY_HEADROOM

    profile = copy.deepcopy(load_profile("dgx_a100"))
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int(7.5e6 / MEMORY_HEADROOM)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(profile))
    common = [WIDE_MLP, "--topology", str(path), "--world-size", "8", "--batch-size", "2"]
    searched = _plan(*common)
    assert searched["plans"][0]["fits"] and "pp" not in searched["plans"][0]["strategy"]
    assert not any("pp" in p["strategy"] for p in searched["plans"])
    assert (
        "pp=2 (1 mesh): not priced, none fits: each pipeline rank holds its parameters' gradients whole, summed over "
        "microbatches until the step's end, its stages' gathered parameters while they run, and its shards of the "
        "parameters and optimizer state (11.7 MiB on the busiest rank at the least, at any schedule and split, over "
        "the 7.2 MiB a rank may hold)"
    ) in " | ".join(searched["skipped"]), searched["skipped"]
    asked = _plan(*common, "--axes", "fsdp,pp")
    pipelines = [p for p in asked["plans"] if p["strategy"] == "pp=2,fsdp=4"]
    assert pipelines and not any(p["fits"] for p in pipelines)
    assert all(p["memory_bytes"]["peak"] > 7.5e6 for p in pipelines)


@pytest.mark.slow  # a search and a pipeline build (20 s); CI runs it
def test_build_strategy_auto_builds_a_pipeline_where_links_are_slow(tmp_path):
    """With 10 MB/s between the GPUs, dp, fsdp and tp wait on their collectives while a pipeline
    sends a few activations: the pipeline plan is priced, ranks first (zero-bubble, whose weight
    gradients fill the wait for the other stage), and `--strategy auto` builds it with the schedule
    and microbatches it was priced at."""
    profile = copy.deepcopy(load_profile("dgx_a100"))
    profile["name"] = "dgx_a100_slow_links"
    for link in profile["node"]["links"]:
        link["nvlink"]["gb_per_s_per_direction"] = 0.01
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    art = tmp_path / "art"
    args = ["build", GPT, "--topology", str(path), "--world-size", "2", "--strategy", "auto", "--no-onnx", "--no-eval", "-o", str(art)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = Artifact(art).manifest  # digest, schema and files check out
    # the plan `--strategy auto` chose is the search's first (`aot plan`'s own, one search less)
    best = manifest["plan"]["candidates"][0]
    assert best["strategy"] == "pp=2" and best["pipeline"]["schedule"] == "zero-bubble", best
    assert manifest["build"]["strategy"] == "pp=2"
    assert manifest["pipeline"]["microbatches"] == best["pipeline"]["microbatches"] and manifest["pipeline"]["schedule"] == best["pipeline"]["schedule"]
    plan = manifest["plan"]
    assert plan["pipeline"]["microbatches"] == best["pipeline"]["microbatches"] and plan["timeline"] in manifest["files"]
    # the planner's prediction is the build's: the same programs simulated side by side
    assert plan["predicted"]["step_s"] == pytest.approx(best["step_s"], rel=1e-9) == manifest["time"]["predicted"]["step_s"]
    assert plan["predicted"]["memory_bytes"]["peak"] == best["peak_memory_bytes"] == manifest["memory"]["predicted"]["peak"]


@pytest.mark.slow  # a search of pipelines, plain and recomputed, and a build (25 s); CI runs it
def test_pipelines_priced_recomputing_stages_where_the_plain_ones_do_not_fit(tmp_path):
    """On GPUs too small for any pipeline's plain programs (gpt.py, pp=2: 1.81 MB at the least, 8
    microbatches) the planner prices each configuration recomputing every stage, as the build then
    does, and the build of the plan chosen recomputes and predicts its step and peak exactly."""
    from aot.plan.search import MEMORY_HEADROOM

    profile = copy.deepcopy(load_profile("dgx_a100"))
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int(1_650_000 / MEMORY_HEADROOM)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(profile))
    best = _plan(GPT, "--topology", str(path), "--world-size", "2", "--axes", "pp", "--batch-size", "8")["plans"][0]
    assert best["fits"] and best["pipeline"]["recompute"] == "stages", best
    pipeline = best["pipeline"]
    art = tmp_path / "art"
    args = ["build", GPT, "--topology", str(path), "--world-size", "2", "--strategy", "pp=2", "--batch-size", "8", "--no-onnx", "--no-eval", "-o", str(art)]
    args += ["--microbatches", str(pipeline["microbatches"]), "--pp-schedule", pipeline["schedule"]]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = Artifact(art).manifest
    assert manifest["memory"]["recompute"]["policy"] == "stages" and manifest["memory"]["recompute"]["source"] == "device memory"
    assert manifest["memory"]["recompute"]["peak_without_recompute"] > MEMORY_HEADROOM * next(iter(profile["node"]["gpus"].values()))["memory_bytes"]
    assert manifest["time"]["predicted"]["step_s"] == pytest.approx(best["step_s"], rel=1e-9)
    assert manifest["memory"]["predicted"]["peak"] == best["memory_bytes"]["peak"]


# Models the planner composes from a few of their blocks (6 blocks, traced cut to 3 and stamped
# out: aot/plan/repeated_blocks.py), dense and mixture-of-experts, and the meshes to build from
# each plan: every axis, a wider fsdp axis derived from the fsdp=2 trace, 2-D meshes
GPT6, MOE6 = (str(REPO / "tests" / "models" / name) for name in ("gpt6.py", "moe6.py"))
GSHARD = str(REPO / "tests" / "models" / "zoo" / "gshard_moe_sgd.py")
PLAN_VS_BUILD = [
    (GPT6, ("--topology", "dgx_a100", "--world-size", "4"), (), ["dp=4", "fsdp=4", "dp=2,fsdp=2", "tp=4", "dp=2,tp=2", "fsdp=2,tp=2"]),
    # experts' gradients laid out transposed (copied contiguous before bucketing), flat routing
    # values the size of a parameter's shard (not resized with the fsdp axis)
    (MOE6, ("--topology", "dgx_h100", "--world-size", "4"), ("--axes", "dp,fsdp,ep"), ["dp=2,ep=2", "ep=4", "fsdp=4", "fsdp=2,ep=2"]),
    # two nodes: all_reduces across them split in two levels (aot/passes/hierarchical.py)
    (GPT6, ("--topology", "dgx_a100", "--nodes", "2", "--world-size", "16"), (), ["dp=16", "dp=4,fsdp=4", "dp=8,tp=2"]),
    # pipelines, built at the schedule, microbatches and stages per rank they were priced at
    (GPT6, ("--topology", "dgx_a100", "--world-size", "4"), ("--axes", "fsdp,pp"), ["pp=4", "pp=2,fsdp=2"]),
    # a ModuleList's experts, stacked under ep as the build stacks them
    (GSHARD, ("--topology", "dgx_h100", "--world-size", "4"), ("--axes", "dp,fsdp,ep"), ["dp=2,ep=2", "ep=4", "fsdp=2,ep=2"]),
]


@pytest.mark.slow  # a search and up to 12 builds each (4 min in all); CI runs it
@pytest.mark.parametrize("model,machine,axes,strategies", PLAN_VS_BUILD, ids=["gpt6", "moe6", "gpt6-2-nodes", "gpt6-pipelines", "gshard-module-list"])
def test_every_plans_step_and_peak_are_its_builds(model, machine, axes, strategies, tmp_path):
    """The planner's predicted step time and peak per rank are the build's prediction for the same
    mesh and bucket size, exactly: buckets packed analytically are issued in the build's order
    (collectives due at one op in graph order) and priced with the copies the build makes, live
    as the built step holds them (each member's gradient until packed, the bucket until its last
    member's result is read), fsdp gathers one parameter ahead as built, and a graph derived
    for a wider fsdp axis resizes only its shards and padded whole parameters, and an all_reduce
    across nodes is priced as the three collectives it is split into, compute waiting for the
    first two. Each mesh at its default bucket size and at its smallest (the most buckets); a
    pipeline mesh (one stage per rank, and fsdp inside the stages) at the schedule, microbatches
    and stages per rank it was priced at."""
    out = _plan(model, *machine, *axes)
    rows: dict[tuple, dict] = {}
    for p in out["plans"]:
        if p["recompute"] is None:
            rows[(p["strategy"], p["bucket_mb"])] = p
    for strategy in strategies:
        buckets = sorted(b for s, b in rows if s == strategy)
        assert buckets, (strategy, sorted(rows))
        for bucket in sorted({25.0, buckets[0]} & set(buckets)):
            art = tmp_path / f"{strategy}-{bucket}"
            args = ["build", model, *machine, "--strategy", strategy, "--bucket-mb", str(bucket), "--no-onnx", "--no-eval", "--quiet"]
            pipeline = rows[(strategy, bucket)].get("pipeline")
            if pipeline:
                args += ["--microbatches", str(pipeline["microbatches"]), "--pp-schedule", pipeline["schedule"]]
                args += ["--stages-per-rank", str(pipeline["stages_per_rank"])]
            result = CliRunner().invoke(cli, [*args, "-o", str(art)], catch_exceptions=False)
            assert result.exit_code == 0, result.output
            manifest = Artifact(art).manifest
            planned, built = rows[(strategy, bucket)], manifest["time"]["predicted"]
            assert planned["step_s"] == built["step_s"], (strategy, bucket, planned["step_s"], built["step_s"])
            assert planned["memory_bytes"]["peak"] == manifest["memory"]["predicted"]["peak"], (strategy, bucket, planned["memory_bytes"])


def test_build_strategy_auto_records_the_plan_and_its_timeline(tmp_path):
    art = tmp_path / "art"
    result = CliRunner().invoke(
        cli, ["build", MLP, "--topology", "cpu", "--world-size", "2", "--strategy", "auto", "--no-onnx", "--quiet", "-o", str(art)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    manifest = Artifact(art).manifest  # digest, schema and files check out
    plan = manifest["plan"]
    assert plan["strategy"] == manifest["build"]["strategy"] and plan["bucket_mb"] == manifest["build"]["bucket_mb"]
    assert plan["candidates"][0]["strategy"] == plan["strategy"]
    predicted = plan["predicted"]
    assert predicted["step_s"] > 0 and predicted["memory_bytes"]["peak"] > predicted["memory_bytes"]["params"]
    assert predicted["collectives_per_step"] == len(manifest["programs"]["train"]["collectives"])
    assert plan["timeline"] == "plan/timeline.json" and "plan/timeline.json" in manifest["files"]
    trace = json.loads(Artifact(art).read("plan/timeline.json"))
    lanes = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
    assert lanes == {"compute", "comm"} and trace["otherData"]["predicted_step_s"] == predicted["step_s"]
    shown = CliRunner().invoke(cli, ["inspect", str(art)], catch_exceptions=False).output
    assert "predicted" in shown and "plan/timeline.json" in shown
    summary = json.loads(CliRunner().invoke(cli, ["inspect", str(art), "--json"], catch_exceptions=False).output)
    assert summary["plan"]["predicted"]["step_s"] == predicted["step_s"]


@pytest.mark.slow  # CPU ranks' calibration, timed three times (26 s); CI runs it
@pytest.mark.alone  # compares this machine's speed measured two ways: nothing may run beside it
def test_calibrate_under_torchrun_writes_a_profile_the_planner_reads(tmp_path):
    """The profile calibrate writes on 2 CPU ranks holds figures of this machine: matmul FLOP/s,
    copy bandwidth, GELU's time per element and all_reduce's alpha-beta line are each within a
    factor of 3 of what tests/helpers/machine_timing.py (plain torch, timed its own way) measures on
    the same ranks right before and after (side by side on this shared 2-core machine they differ by 1.0-2x),
    and the planner reads them back."""
    from helpers.commands import REPO, ok, torchrun

    def timed(name: str) -> dict:
        ok(torchrun(2, REPO / "tests" / "helpers" / "machine_timing.py", tmp_path / name, module=None))
        return json.loads((tmp_path / name).read_text())

    # timed on either side of the calibration: the machine's load during it lies between (CI once
    # saw GELU 3.6x slower in the calibration than in a timing after it, on a loaded machine)
    before = timed("before.json")
    out = tmp_path / "cal.json"
    proc = ok(torchrun(2, "topology", "calibrate", "--profile", "cpu", "-o", out, "--max-bytes", 65536, "--reps", 2, "--rounds", 2))
    assert "round 2 of 2" in proc.stderr  # compute and the stall measured twice, a median (and a pool) of the two
    profile = load_profile(str(out))  # validates
    loopback = profile["calibration"]["loopback"]
    assert set(loopback["per_kind"]) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert [n for n, _ in loopback["measured"]["all_reduce"]] == [4096 * 2**i for i in range(5)]
    assert [n for n, _ in loopback["measured"]["send_recv"]] == [4096 * 2**i for i in range(5)]
    compute = profile["compute"]
    assert compute["flops_per_s"]["float32"] > 0 and compute["op_overhead_s"] >= 0 and 0 < compute["efficiency"] <= 1
    assert compute["collective_stall_s"] >= 0 and compute["rounds"] == 2  # measured on these CPU ranks, priced into CPU plans
    by_segment = compute["collective_stall_by_segment"]  # its distribution by compute before it, summed by plans
    assert [len(stall) for _, stall in by_segment] == [40] * 7 and all(stall == sorted(stall) for _, stall in by_segment)
    assert [seconds for seconds, _ in by_segment] == sorted(seconds for seconds, _ in by_segment)
    by_kind = compute["collective_stall_by_kind"]  # each kind measured on its own; the default table is the all_reduce's
    assert set(by_kind) == {"all_reduce", "all_gather", "reduce_scatter"} and by_kind["all_reduce"] == by_segment
    assert all([len(stall) for _, stall in table] == [40] * 7 for table in by_kind.values())
    machine = Machine(profile, 2)
    assert machine.compute.calibrated and machine.compute.collective_stall_s == compute["collective_stall_s"]
    assert machine.compute.collective_stall_by_segment == tuple((s, tuple(v)) for s, v in by_segment)
    assert machine.compute.collective_stall_by_kind["all_gather"] == tuple((s, tuple(v)) for s, v in by_kind["all_gather"])
    assert machine.compute.element_seconds["gelu"] > 0 and machine.compute.foreach_tensor_s >= 0
    assert machine.compute.dispatch_s["addmm"][0] > 0 and machine.compute.dispatch_s["_foreach_add_"][1] > 0
    span = machine.span([0, 1], "all_gather")
    assert span.intra.alpha == loopback["per_kind"]["all_gather"]["alpha_s"]
    assert machine.span([0, 1], "send_recv").flat().alpha == loopback["per_kind"]["send_recv"]["alpha_s"] > 0
    shown = CliRunner().invoke(cli, ["topology", "show", str(out)], catch_exceptions=False).output  # per kind, for people
    assert f"    send_recv       alpha {loopback['per_kind']['send_recv']['alpha_s'] * 1e6:.3g} us" in shown, shown

    after = timed("after.json")

    def within_3x(calibrated: float, key: str, what: str, size: str | None = None) -> None:
        measured = sorted(t[key][size] if size else t[key] for t in (before, after))
        assert measured[0] / 3 <= calibrated <= measured[1] * 3, f"{what}: calibrated {calibrated:.3g}, measured here {measured[0]:.3g} .. {measured[1]:.3g}"

    within_3x(compute["flops_per_s"]["float32"], "matmul_flops_per_s", "matmul FLOP/s")
    within_3x(compute["memory_bytes_per_s"], "copy_bytes_per_s", "copy bytes/s")
    within_3x(machine.compute.element_seconds["gelu"], "gelu_seconds_per_element", "GELU s per element")
    # a pipeline's transfer (the functional isend / irecv its programs issue): plain dist.send /
    # dist.recv's one-way time, plus what issuing the functional ops adds (measured here: 1.3-3x)
    pair = machine.span([0, 1], "send_recv").flat()
    for nbytes in after["send_recv_s"]:
        predicted = pair.alpha + int(nbytes) * pair.beta
        measured = sorted(t["send_recv_s"][nbytes] for t in (before, after))
        assert measured[0] / 2 <= predicted <= measured[1] * 5, f"send_recv of {nbytes} bytes: calibrated {predicted:.3g}, measured here {measured}"
    ring = machine.span([0, 1], "all_reduce")
    for nbytes in after["all_reduce_s"]:  # the ring at 2 ranks: 2 alpha + n beta
        predicted = 2 * ring.intra.alpha + int(nbytes) * ring.intra.beta
        assert predicted == pytest.approx(2 * loopback["alpha_s"] + int(nbytes) * loopback["beta_s_per_byte"])
        within_3x(predicted, "all_reduce_s", f"all_reduce of {nbytes} bytes", nbytes)


def test_runner_applies_the_planned_nccl_algorithm_unless_the_user_set_one(tmp_path):
    """A dgx_a100 build records NCCL_ALGO in its plan; a runner on NCCL sets it before NCCL starts,
    and a value already in the environment wins (checked on the function the runner calls: this
    machine has no NCCL)."""
    from runner.execution.trainer import nccl_algorithm

    art = tmp_path / "art"
    result = CliRunner().invoke(
        cli, ["build", MLP, "--topology", "dgx_a100", "--world-size", "8", "--strategy", "auto", "--no-onnx", "--quiet", "-o", str(art)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    manifest = Artifact(art).manifest
    planned = manifest["plan"]["nccl_algo"]
    assert planned and planned.startswith("allreduce:")
    env, said = {}, []
    assert nccl_algorithm(manifest, env, said.append) == planned and env["NCCL_ALGO"] == planned
    env = {"NCCL_ALGO": "allreduce:ring"}
    assert nccl_algorithm(manifest, env, said.append) == "allreduce:ring" and env["NCCL_ALGO"] == "allreduce:ring"
    assert "from the environment" in said[-1] and planned in said[-1]


@pytest.mark.alone  # the measured exposed communication against the measured step
def test_run_profile_is_compared_with_the_plan_by_inspect(tmp_path):
    """`aot run --profile DIR` writes a measured Chrome trace and step summary; `aot inspect
    --profile DIR` puts measured step, compute and exposed communication next to the prediction."""
    from helpers.commands import aot, ok, torchrun

    art, prof = tmp_path / "art", tmp_path / "prof"
    ok(aot("build", MLP, "--topology", "cpu", "--world-size", 2, "--strategy", "auto", "--no-onnx", "-o", art, "--quiet"))
    r = ok(torchrun(2, "run", art, "--steps", 10, "--profile", prof))
    assert "profiled 5 step(s)" in r.stderr
    trace = json.loads((prof / "measured_timeline.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "_c10d_functional::wait_tensor" in names  # the collectives' waits are on the timeline
    summary = json.loads(ok(aot("inspect", art, "--profile", prof, "--json")).stdout)["measured"]
    assert summary["steps_profiled"] == 5 and summary["tier"] == "portable"
    times = summary["times"]
    assert times["step_s"]["measured"] > 0 and times["step_s"]["predicted"] > 0
    assert times["step_s"]["ratio"] == pytest.approx(times["step_s"]["measured"] / times["step_s"]["predicted"])
    assert 0 <= times["exposed_comm_s"]["measured"] <= times["step_s"]["measured"] * 5
    text = ok(aot("inspect", art, "--profile", prof)).stdout
    assert "measured/predicted" in text and "exposed communication" in text


def test_plan_prices_sequence_parallel_as_the_build_makes_it():
    """tp=4 on 4 ranks: row-wise outputs all-reduced without --sequence-parallel; all-gathered and
    reduce-scattered along the sequence with it, and fewer activation bytes held per rank."""
    plain = _plan(GPT, "--topology", "dgx_a100", "--world-size", "4", "--axes", "tp", "--bucket-mb", "25")["plans"][0]
    sp = _plan(GPT, "--topology", "dgx_a100", "--world-size", "4", "--axes", "tp", "--bucket-mb", "25", "--sequence-parallel")["plans"][0]
    assert plain["strategy"] == sp["strategy"] == "tp=4"
    assert set(plain["algorithms"]) == {"all_reduce:double_binary_tree"}
    assert {k.split(":")[0] for k in sp["algorithms"]} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert sp["memory_bytes"]["peak_transient"] < plain["memory_bytes"]["peak_transient"]


def _gradients(steps, fsdp: int) -> int:
    """Bytes of every parameter's gradient as the pipeline ranks of an fsdp mesh sum them."""
    from aot.plan.pipeline_floor import gradient_bytes

    return sum(gradient_bytes(steps.recording().state, steps.layout(1, 1, 1), steps.precision, fsdp).values())
