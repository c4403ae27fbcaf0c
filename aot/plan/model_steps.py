"""Step graphs of a model file for any mesh the search prices, traced as few times as possible.

The planner (aot/plan/search.py) asks for the graph of one rank for each mesh it prices; this
module makes them from a handful of traces (see ModelSteps) and says which meshes the build
cannot trace yet (Unsupported).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aot.capture.backward_reads import BackwardReads
from aot.compile_step import Recording, finish_program, step_layout, tensor_parallel_plan, trace_program
from aot.capture.expert_parallel import expert_layers
from aot.capture.listed_experts import listed_experts
from aot.errors import AotError
from aot.passes import PRICED_ANALYTICALLY, PassOptions
from aot.plan.cost_model import StepGraph
from aot.plan.step_reading import analyze
from aot.plan.mesh import Mesh
from aot.plan.plans import mesh_words
from aot.plan.pipeline_floor import PipelineHoldings, holdings_of
from aot.plan.recompute import Request
from aot.plan.repeated_blocks import NotComposable, cut_plan, find_blocks, stamp, truncated, widen_plan, widened_reads
from aot.plan.tensor_parallel import Finding, read_plan
from aot.plan.step_synthesis import NotSynthesizable
from aot.plan import variant_budgets
from aot.plan.written_out import DEPTHS, recomputing_written_out, written_out
from aot.capture.module_calls import annotating_blocks
from aot.target import Target
from runner.format.axes import DP, EP, FSDP, PP, TP, group_name

NO_RECOMPUTE = Request()  # as the build without a flag or model-file `recompute`: the model's checkpoint calls only


class Unsupported(Exception):
    """The build cannot yet trace a graph for this mesh."""


@dataclass(frozen=True)
class Pricing:
    """What a model's steps are priced for, the part of the planning that depends on the profile:
    the profile (its precision rules), ranks, the widest tp (ranks per node), the precision asked,
    the memory limit whose plans get recomputing variants (aot.plan.search.MemoryLimit) and the
    device model pricing recomputation's choices (aot.plan.device_model: the build's, for the same
    profile). Without `compute`, no variants."""

    profile: dict = field(default_factory=lambda: {"device_kind": "cpu"})
    world_size: int | None = None
    max_tp: int | None = None
    precision: str | None = None
    reduce_dtype: str | None = None
    memory_limit: Any = None
    compute: Any = None


def _key(dp: int, fsdp: int, tp: int, ep: int = 1) -> tuple:
    """A layout class (see ModelSteps): whether there is a dp group, fsdp, tp, and ep where there is one."""
    return (dp > 1, fsdp, tp, *([ep] if ep > 1 else []))


def _mesh(dp: int, fsdp: int, tp: int, ep: int = 1) -> tuple:
    """A traced mesh (dp, fsdp, tp), with ep where there is one."""
    return (dp, fsdp, tp, *([ep] if ep > 1 else []))


class ModelSteps:
    """Step graphs of a model file for any mesh over the axes the build supports (dp, fsdp, tp,
    and ep for a model with experts: each ep degree its own layout class, keyed and derived as the
    others).

    Graphs: (dp, fsdp=1) and (dp, fsdp=2) per tensor-parallel degree, each once (the
    data-parallel degree changes only the group's size, never the graph). A wider fsdp axis is the
    fsdp=2 graph re-read with its shards resized (derived_steps.rescale), and fsdp without dp is the
    dp x fsdp graph without its dp collectives (derived_steps.drop_group), so a search over every
    factorization of 1024 ranks needs two graphs per tp degree. On 2 ranks (no dp x fsdp mesh)
    fsdp=2 is traced alone. tp is priced only within a node (`max_tp`, the ranks per node) and where
    the model can take it (heads and split features divide, aot.plan.tensor_parallel).

    A model of repeated blocks (aot.plan.repeated_blocks.find_blocks: a decoder's layers) is traced
    cut to 3 of them and its middle block written out to full depth (`compose=False`: traced
    whole), the graph a whole trace gives node for node; where that cannot be done it is traced
    whole, with a note.

    Tracing is most of a search's time, so graphs are cached by layout: one trace per layout class
    (key (dp > 1, fsdp, tp): whether there is a dp group, fsdp 1 or 2, the tp degree), whatever the
    ranks, and read for every mesh of that class. Each trace is make_fx's, as the build's
    (capture_step(tracer=aot.plan.pricing.trace_for_pricing): without generating code), and the
    (dp, fsdp=1) graph is derived from the (dp, fsdp=2) one of its tp degree: the same forward and
    backward, then the step's end (averaging, clipping, the optimizer) traced alone
    (aot.plan.pricing.derive_without_fsdp; traced in full where the graph is not of that form), each
    the very graph the build traces for that mesh (tests/test_plan_derived_graphs.py). aot.plan.layout_traces.prefetch
    makes, before the search, the graphs it will ask for.

    Recomputation (`recomputing`): a graph (traced or derived) from which a plan may not fit device
    memory (`memory_limit`) is also rewritten as the build would recompute it
    (aot.passes.recompute.by_budget on the graph before the other passes, as
    aot.plan.recompute.apply_request does) and analyzed, at the activation budgets of
    aot.plan.variant_budgets where its step is written out from a few blocks (about FIRST_TARGET of
    the saved bytes kept, and every layer checkpointed), else at FIRST_TARGET and, where that may
    still not fit, at the smallest feasible one; its derived meshes get the same derivation. A
    graph that fits costs nothing more."""

    def __init__(
        self,
        model_path: Path,
        batch_size: int,
        seed: int = 0,
        sequence_parallel: bool = False,
        pricing: Pricing | None = None,
        note=None,
        compose: bool = True,
        moe_capacity_factor: float | None = None,
    ):
        from aot.capture.model_file import load_model_file
        from aot.capture.training_state import build_training_state
        from runner.execution.data import split_batch_tensors

        if batch_size < 1:
            raise AotError(f"--batch-size must be at least 1, got {batch_size}")
        started = time.perf_counter()
        # where planning's time goes (`aot plan --json`'s "time"), and a line per long piece of work
        self.seconds = {"recording": 0.0, "tracing": 0.0, "recomputing": 0.0, "pipelines": 0.0}  # recomputing: part of tracing
        self.workers = 1  # processes that made the graphs and prices (aot.plan.workers; plan_model sets it)
        self.bound: Any = None  # the search's aot.plan.class_floor.ClassBound: which classes are left unpriced
        self._held: dict[tuple, Any] = {}  # key -> its cut trace, traced ahead to judge it (layout_traces.prefetch)
        self.note = note or (lambda line: None)
        mf = load_model_file(model_path)
        self.request = (Path(model_path), batch_size, seed, sequence_parallel, moe_capacity_factor)  # what `retargeted` copies may share
        self.moe_capacity_factor = moe_capacity_factor  # ep meshes priced with this expert capacity (None: dropless)
        inputs, targets = split_batch_tensors(mf.example_batch(batch_size), "batch()")
        self.rec = Recording(mf, build_training_state(mf, seed, 1, record=False), inputs, targets)  # every trace's, as the build's (aot/compile_step.py)
        self.seconds["recording"] = time.perf_counter() - started
        self.params = sum(p.numel() for p in self.state.params.values())
        self.param_numels = [p.numel() for p in self.state.params.values()]
        self.sequence_parallel = sequence_parallel  # price tp meshes with sequence parallelism (--sequence-parallel)
        self._tp_plans: dict[int, dict[str, str] | AotError] = {}  # degree -> the build's plan, or why it refuses
        # (name, count) of the model's repeated blocks, traced cut to a few (aot.plan.repeated_blocks)
        self.blocks = find_blocks(self.state.model) if compose else None
        # a deeper model's graphs written out from a few depths' (aot.plan.written_out); False:
        # from its graph of every block, written out from the cut trace
        self.write_out = True
        # a model with experts (aot.capture.expert_parallel, or a ModuleList's, stacked under ep
        # as the build stacks them: aot.capture.listed_experts) is searched over ep too
        self.listed_experts = bool(listed_experts(self.state.model))
        self.has_experts = bool(expert_layers(self.state.model)) or self.listed_experts
        self._stacked: Recording | None = None
        self._stacked_cut: Recording | None = None
        self._backward_reads: BackwardReads | None | bool = False  # pipeline_holdings' (False: not yet asked)
        self._cut: Recording | None = None
        self._plan_read: Finding | None = None  # _read_plan's, once read
        self._target(pricing or Pricing())

    def _target(self, pricing: Pricing) -> None:
        """What depends on the profile planned for, with no graph traced for it yet."""
        from aot.capture.precision import resolve_precision

        profile, world_size, max_tp, compute = pricing.profile, pricing.world_size, pricing.max_tp, pricing.compute
        precision, reduce_dtype, memory_limit = pricing.precision, pricing.reduce_dtype, pricing.memory_limit

        # --precision as the build resolves it: bf16 graphs carry half the activation and
        # collective bytes, and their matmuls are priced at the profile's bf16 rate
        self.precision = resolve_precision(precision, reduce_dtype, self.mf.globals, self.mf.path.name, profile)
        self.world_size = world_size
        self.max_tp = max_tp
        self._numels: dict[tuple, list[int]] = {}  # (tp, ep) -> _local_numels'
        self.traced: dict[tuple, StepGraph] = {}
        # `pipeline`'s (programs, analyses), apart from `traced`: their stages are balanced on the
        # profile's compute, so `retargeted` keeps none of them
        self.pipelines: dict[tuple, tuple[list, list[StepGraph]]] = {}
        self._forwards: dict[tuple, dict] = {}  # (dp, fsdp, tp) -> that layout's traced microbatch forwards (pipeline_programs)
        self._floors: dict[tuple, PipelineHoldings] = {}  # (fsdp, tp, ep) -> pipeline_holdings
        self._failed: dict[tuple, Exception] = {}  # key -> what tracing it raised (raised again when asked)
        self._derived: dict[tuple, list] = {}  # traced key -> [(key, mesh)] derived from its graph (layout_traces.prefetch)
        # graphs from which a plan may not fit device memory (`memory_limit`: the planner's
        # aot.plan.search.MemoryLimit) also get recomputing variants, their choices priced on
        # `compute` (the device model, aot.plan.device_model: the build's, for the same profile)
        self.memory_limit = memory_limit if compute is not None else None
        self.compute = compute
        if compute is None:  # the model's checkpoint calls are still recomputed as the build would, priced on a CPU
            from aot.plan.cpu_gloo_model import CpuGlooModel

            compute = CpuGlooModel.from_profile({})
        self._compute = compute
        self.recomputed: dict[tuple, list[tuple[float, StepGraph]]] = {}  # key -> [(activation budget, graph)]
        self._recomputing: dict[tuple, list[tuple[float, StepGraph]]] = {}  # `recomputing`'s, by what the mesh's graphs depend on
        self.recompute_failed: dict[tuple, str] = {}  # key -> why its variants could not be made
        self.class_floors: dict[tuple, float] = {}  # key -> the least seconds a sample of its plans (`bound`'s)

    # the recording's parts, as the search and the tests ask for them
    mf = property(lambda self: self.rec.mf)
    state = property(lambda self: self.rec.state)
    inputs = property(lambda self: self.rec.inputs)
    targets = property(lambda self: self.rec.targets)

    def tp_plan(self, tp: int) -> dict[str, str]:
        """The plan the build would use at this degree (aot.compile_step.tensor_parallel_plan);
        Unsupported where the build would refuse."""
        if self.max_tp is not None and tp > self.max_tp:
            raise Unsupported(f"tp={tp} would span nodes ({self.max_tp} ranks per node)")
        if tp not in self._tp_plans:
            try:
                self._tp_plans[tp] = self._found_plan(tp)
            except AotError as e:
                self._tp_plans[tp] = e
        plan = self._tp_plans[tp]
        if isinstance(plan, AotError):
            raise Unsupported(str(plan)) from None
        return plan

    def _found_plan(self, tp: int) -> dict[str, str]:
        """The build's plan at degree `tp`: for a model of repeated blocks without a tp_plan of its
        own, found on the model cut to 3 blocks (running its forward split is most of the search,
        and it grows with depth) and read out to every block (aot.plan.repeated_blocks.widen_plan)."""
        from aot.plan.tensor_parallel import user_plan

        if self.blocks is None or user_plan(self.mf, self.state.model) is not None:
            return tensor_parallel_plan(self.rec, tp)
        return widen_plan(tensor_parallel_plan(self._cut_recording(), tp, read=self._read_plan), *self.blocks)

    def _read_plan(self) -> Finding:
        """The pairs read from the cut model's forward (an export, 0.5 s for 8B), once for every tp degree."""
        cut = self._cut_recording()
        self._plan_read = self._plan_read or read_plan(cut.state.model, cut.inputs)
        return self._plan_read

    def _cut_recording(self, ep: int = 1) -> Recording:
        assert self.blocks is not None
        if ep > 1 and self.listed_experts:
            if self._stacked_cut is None:
                self._stacked_cut = truncated(self.recording(ep), self.blocks[0])
            return self._stacked_cut
        if self._cut is None:
            self._cut = truncated(self.rec, self.blocks[0])
        return self._cut

    def recording(self, ep: int = 1) -> Recording:
        """What a mesh of ep degree `ep` traces: the model's state, or under ep with a ModuleList's
        experts, that state with them stacked (the build's: aot/build.py `_record`)."""
        if ep == 1 or not self.listed_experts:
            return self.rec
        if self._stacked is None:
            from aot.capture.listed_experts import stack_experts
            from aot.capture.training_state import build_training_state

            state = stack_experts(build_training_state(self.mf, self.request[2], 1, record=False), self.mf.path.name)
            self._stacked = Recording(self.mf, state, self.inputs, self.targets)
        return self._stacked

    def target(self, dp: int, fsdp: int, tp: int, ep: int = 1) -> Target:
        return Target.of({DP: dp, FSDP: fsdp, TP: tp, EP: ep}, self.precision, self.sequence_parallel, self.moe_capacity_factor)

    def layout(self, dp: int, fsdp: int, tp: int, ep: int = 1):
        """The build's layout of a dp x fsdp x tp (x ep) mesh (aot.compile_step.step_layout); Unsupported where the build would refuse."""
        plan = self.tp_plan(tp) if tp > 1 else {}
        try:
            return step_layout(self.recording(ep), self.target(dp, fsdp, tp, ep), plan)
        except AotError as e:
            raise Unsupported(str(e)) from None

    def capture(self, dp: int, fsdp: int, tp: int = 1, ep: int = 1) -> StepGraph:
        """The analyzed graph of one rank for a dp x fsdp x tp (x ep) mesh, traced as the build traces it."""
        return self._finished(*self._capture(dp, fsdp, tp, ep))

    def _capture(self, dp: int, fsdp: int, tp: int, ep: int = 1):
        """(graph, slots) of the mesh, traced and cleaned up as the build's (aot.compile_step.trace_program):
        for a model of repeated blocks, the model cut to a few blocks traced and written out to
        full depth (aot.plan.repeated_blocks: the same graph, node for node); traced whole where
        that cannot be done."""
        if self.blocks is not None:
            try:
                return self._composed(dp, fsdp, tp, ep)
            except Unsupported:
                raise
            except Exception as e:  # noqa: BLE001  (NotComposable, or the cut model's trace failing: a forward that counts its blocks)
                why = str(e) if isinstance(e, NotComposable) else f"the model cut to 3 of them cannot be traced: {type(e).__name__}"
                self.note(f"tracing the whole model: its blocks cannot be written out from a few ({why})")
                self.blocks = None
        captured = trace_program(self.recording(ep), self.layout(dp, fsdp, tp, ep), for_pricing=True)
        return captured.graph, captured.slots

    def _composed(self, dp: int, fsdp: int, tp: int, ep: int = 1):
        assert self.blocks is not None
        captured = self._cut_trace(dp, fsdp, tp, ep)
        return stamp(captured.graph, captured.slots, *self.blocks)

    def _cut_trace(self, dp: int, fsdp: int, tp: int, ep: int = 1):
        """The mesh's step of the model cut to 3 blocks, traced with its blocks annotated."""
        assert self.blocks is not None
        path = self.blocks[0]
        plan = cut_plan(self.tp_plan(tp), path) if tp > 1 else {}
        try:
            layout = step_layout(self._cut_recording(ep), self.target(dp, fsdp, tp, ep), plan)
        except AotError as e:
            raise Unsupported(str(e)) from None
        with annotating_blocks(path):
            return trace_program(self._cut_recording(ep), layout, for_pricing=True)

    def program(self, dp: int, fsdp: int, tp: int = 1, skip: tuple[str, ...] = PRICED_ANALYTICALLY, ep: int = 1):
        """The graph module the planner prices for a dp x fsdp x tp (x ep) mesh, traced (not derived):
        the build's program for it but for the passes in `skip` (tests/test_compile_path.py)."""
        gm, slots = self._capture(dp, fsdp, tp, ep)
        return self.passed(gm, slots, NO_RECOMPUTE, skip)[0]

    def passed(self, gm, slots, request: Request = NO_RECOMPUTE, skip: tuple[str, ...] = PRICED_ANALYTICALLY) -> tuple:
        """(`gm`, changed in place, as the passes leave it for pricing (see _finished), with `request`'s
        recomputation; what was recomputed, as the manifest's `memory.recompute`)."""
        return finish_program(gm, slots, request, self._compute, PassOptions(), skip=skip)

    def _finished(self, gm, slots, aliases: dict | None = None, request: Request = NO_RECOMPUTE) -> StepGraph:
        """The analyzed graph of a traced step as the build's passes leave it (aot.compile_step.finish_program,
        the model's torch.utils.checkpoint calls recomputed as the build does without a flag), but for
        those priced analytically (aot.passes.PRICED_ANALYTICALLY: bucketing and hierarchical all_reduce,
        aot/plan/rebucket.py). Peak memory then equals the build's prediction for the same mesh,
        bucket size and recomputation."""
        return analyze(self.passed(gm, slots, request)[0], slots, aliases)

    def _trace(self, key: tuple, source: tuple) -> dict[tuple, StepGraph]:
        """The graph of `key`, traced on mesh `source`, and the graphs derived from it (`_derived`:
        meshes without fsdp from the fsdp=2 graph of the same tp degree, each traced where the
        derivation does not apply). What a derived graph's own trace raises is raised when asked."""
        from aot.plan.pricing import storage_aliases

        if self.write_out and self.blocks is not None and self.blocks[1] > max(DEPTHS):
            made = self._written_out(key, source)
            if made is not None:
                return made
        gm, slots = self._capture(*source)
        out = {}
        for other, (dp, _, tp, *ep) in self._derived.get(key, ()):
            if other in self.traced or other in self._failed:
                continue
            try:
                got = self._without_fsdp(gm, dp, tp, *ep)
                derived = None
                if got is not None:
                    derived_gm, derived_slots, shared = got
                    aliases = storage_aliases(shared)
                    kept = self._kept(derived_gm)
                    derived = self._finished(derived_gm, derived_slots, aliases)
                    self._recompute(other, kept, derived_slots, derived, aliases)
            except Exception:  # noqa: BLE001  (traced instead)
                derived = None
            try:
                out[other] = derived if derived is not None else self._captured(other, dp, 1, tp, *ep)
            except Exception as e:  # noqa: BLE001  (raised again when the search asks for this graph)
                self._failed[other] = e
        out[key] = self._priced(key, gm, slots)  # after the derivations: it changes `gm`
        return out

    def _written_out(self, key: tuple, source: tuple) -> dict[tuple, StepGraph] | None:
        """The graphs `_trace` makes, each written out from the model at a few depths
        (aot.plan.written_out); the graphs from which a plan may not fit get their recomputing
        variants written out too, or from the whole depth where those cannot be. None (with a
        note) where the graphs cannot be written out."""
        derived = [(other, mesh) for other, mesh in self._derived.get(key, ()) if other not in self.traced and other not in self._failed]
        try:
            captured = self._held.pop(key, None) or self._cut_trace(*source)  # held: layout_traces' cut job
            made, shallow = written_out(self, captured, key, derived)
        except (NotSynthesizable, NotComposable) as e:
            self.note(f"pricing {mesh_words(source)} from every block: its step cannot be written out from a few ({e})")
            return None
        needs = [k for k, graph in made.items() if self._needs_variants(k, graph) and not recomputing_written_out(self, k, shallow[k], self._roomier(k, graph))]
        if needs and self.blocks is not None:  # variants that cannot be written out are made from every block
            from aot.plan.pricing import storage_aliases

            gm, slots = stamp(captured.graph, captured.slots, *self.blocks)
            for other, (dp, _, tp, *ep) in derived:
                if other in needs:
                    got = self._without_fsdp(gm, dp, tp, *ep)
                    if got is None:
                        return None
                    derived_gm, derived_slots, shared = got
                    self._recompute(other, derived_gm, derived_slots, made[other], storage_aliases(shared))
            if key in needs:
                self._recompute(key, gm, slots, made[key])
        return made

    def _without_fsdp(self, gm, dp: int, tp: int, ep: int = 1):
        """aot.plan.pricing.derive_without_fsdp of mesh (dp, 1, tp, ep) from `gm`, its fsdp=2 graph."""
        from aot.plan.pricing import derive_without_fsdp

        return derive_without_fsdp(self.mf, self.recording(ep).state, self.inputs, self.targets, self.layout(dp, 1, tp, ep), gm, Mesh.group_name(FSDP))

    def _captured(self, key: tuple, dp: int, fsdp: int, tp: int, ep: int = 1) -> StepGraph:
        return self._priced(key, *self._capture(dp, fsdp, tp, ep))

    def _priced(self, key: tuple, gm, slots) -> StepGraph:
        """_finished(gm, slots), and the recomputing variants of `key` where it does not fit."""
        kept = self._kept(gm)
        graph = self._finished(gm, slots)
        self._recompute(key, kept, slots, graph)
        return graph

    def _kept(self, gm):
        """`gm` as traced, for recomputation (which the build applies before the passes that
        _finished applies to `gm` in place), where variants may be needed."""
        from aot.passes.graph_utils import copy_graph

        return copy_graph(gm) if self.memory_limit is not None else gm

    def _recompute(self, key: tuple, gm, slots, graph: StepGraph, aliases: dict | None = None) -> None:
        """Where plans read from `graph` (the analyzed `gm`) may not fit, its variants recomputing
        activations into `self.recomputed[key]`: at activation budget FIRST_TARGET, and where
        that does not fit but recomputing more might (or is below what can be reached), at the
        smallest feasible budget."""
        if not self._needs_variants(key, graph):
            return
        started = time.perf_counter()
        try:
            self._variants(key, gm, slots, graph, aliases)
        finally:
            self.seconds["recomputing"] += time.perf_counter() - started

    def _variants(self, key: tuple, gm, slots, graph: StepGraph, aliases: dict | None) -> None:
        from aot.plan.step_reading import node_seconds

        assert self.memory_limit is not None  # _needs_variants: there is one
        finish = lambda g, fraction: self._finished(g, slots, aliases, Request(fraction=fraction, source="plan"))  # noqa: E731
        cost = lambda n: node_seconds(n, self.compute)  # noqa: E731
        try:
            self.recomputed[key] = variant_budgets.every_block_variants(gm, finish, cost, self.memory_limit, key[1] > 1, self._roomier(key, graph))
        except Exception as e:  # noqa: BLE001  (the plans without recomputation stand; the search says why)
            self.recompute_failed[key] = f"{type(e).__name__}: {e}"

    def _roomier(self, key: tuple, plain: StepGraph) -> Callable[[float, StepGraph], float | None]:
        """variant_budgets.roomier_target for the variants of graph `key` (`plain`, recomputing
        nothing) at the widest mesh read from it: fsdp over every rank of a tp (and ep) group,
        which holds the least beside activations."""
        _, fsdp, tp, *ep = key
        source, ranks = _mesh(2 if key[0] else 1, fsdp, tp, *ep), tp * (ep[0] if ep else 1)
        if fsdp == 1 or not self.world_size or self.world_size % ranks:
            widest = lambda graph: graph  # noqa: E731  (every mesh of the graph holds alike)
        else:
            widest = lambda graph: self._derive(graph, source, 1, self.world_size // ranks, tp, *ep)  # noqa: E731
        return lambda budget, graph: variant_budgets.roomier_target(self.memory_limit, plain, graph, budget, widest)

    def _needs_variants(self, key: tuple, graph: StepGraph) -> bool:
        """Whether plans read from `graph` may not fit device memory and recomputing could help:
        then the graph gets variants recomputing activations (a graph with fsdp: a wider axis holds
        less of what stays, so it gets them even where this one cannot fit with them)."""
        limit = self.memory_limit
        return limit is not None and limit.over(graph) and not (key[1] == 1 and limit.beyond_recompute(graph))

    def retargeted(self, pricing: Pricing) -> "ModelSteps":
        """The same model's steps for another profile (`aot plan --topology a,b,c`), keeping the
        graphs that do not depend on it. A dp/fsdp/tp graph is a trace of the model under a
        precision: the profile only decides, through its device memory and compute rates, whether
        and how the graph is also priced recomputing activations. So a graph is kept where the
        precision resolves alike and neither profile gives it recomputing variants; the others
        (and pipeline programs, whose stages are balanced on the profile's compute) are traced again."""
        other = copy.copy(self)
        other.seconds = {part: 0.0 for part in self.seconds}  # the graphs kept cost this plan nothing
        other._floors = {}  # in the other profile's precision
        other._target(pricing)
        if other.precision == self.precision:
            other.traced = {
                key: graph
                for key, graph in self.traced.items()
                if key not in self.recomputed and key not in self.recompute_failed and not other._needs_variants(key, graph)
            }
        return other

    def _traced(self, dp: int, fsdp: int, tp: int, ep: int = 1) -> StepGraph:
        key = _key(dp, fsdp, tp, ep)
        if key in self._failed:
            raise self._failed[key]
        if key not in self.traced:
            started = time.perf_counter()
            self.traced.update(self._trace(key, _mesh(dp, fsdp, tp, ep)))
            self.seconds["tracing"] += time.perf_counter() - started
        if key in self._failed:
            raise self._failed[key]
        return self.traced[key]

    def _source(self, dp: int, fsdp: int, tp: int, ep: int = 1) -> tuple:
        """The traced mesh (dp, fsdp, tp[, ep]) a mesh's graph is read from (see the class docstring)."""
        if fsdp == 1:
            return _mesh(dp, 1, tp, ep)
        if dp > 1 or (self.world_size or 0) >= 4 * tp * ep:
            return _mesh(2, 2, tp, ep)
        return _mesh(1, 2, tp, ep)

    def class_key(self, axes: tuple, shape: tuple) -> tuple:
        """The layout class (key) the graph of a mesh without pp is read from."""
        return _key(*self._source(*self._degrees(axes, shape)))

    def __call__(self, axes: tuple, shape: tuple) -> StepGraph:
        dp, fsdp, tp, ep = self._degrees(axes, shape)
        source = self._source(dp, fsdp, tp, ep)
        return self._derive(self._traced(*source), source, dp, fsdp, tp, ep)

    def recomputing(self, axes: tuple, shape: tuple) -> list[tuple[float, StepGraph]]:
        """[(activation budget, the mesh's graph recomputing activations at it)]: empty where the
        graph the mesh is read from fits device memory (call after the mesh's own graph)."""
        dp, fsdp, tp, ep = self._degrees(axes, shape)
        source = self._source(dp, fsdp, tp, ep)
        key = _key(*source)
        if key in self.recompute_failed:
            raise Unsupported(f"recomputing activations: {self.recompute_failed[key]}")
        derived = (key, dp > 1, fsdp, tp, ep)  # the data-parallel degree changes only the group's size
        if derived not in self._recomputing:
            variants = self.recomputed.get(key, ())
            self._recomputing[derived] = [(fraction, self._derive(graph, source, dp, fsdp, tp, ep)) for fraction, graph in variants]
        return self._recomputing[derived]

    def pipeline(
        self, axes: tuple, shape: tuple, microbatches: int, schedule: str = "1f1b", virtual: int = 1, recompute: bool = False
    ) -> tuple[list, list[StepGraph]]:
        """The programs of a pipeline mesh, one per pipeline rank, as the build makes them (default
        bucket size; `recompute`: every stage's forward again in its backward), and their
        analyses; Unsupported where the build would refuse the mesh."""
        from aot.plan.pipeline import check_microbatches
        from aot.plan.pipeline_programs import Reporting, Schedule, pipeline_programs

        degrees = dict(zip(axes, shape))
        pp, dp, fsdp = degrees[PP], degrees.get(DP, 1), degrees.get(FSDP, 1)
        key = (PP, pp, dp > 1, fsdp, degrees.get(TP, 1), microbatches, schedule, virtual, recompute)
        if key not in self.pipelines:
            started = time.perf_counter()
            mesh = ",".join(f"{a}={d}" for a, d in degrees.items() if d > 1)
            how = [schedule, *([f"{virtual} stages per rank"] if virtual > 1 else []), f"{microbatches} microbatches", *(["recomputing"] if recompute else [])]
            try:
                check_microbatches(schedule, pp, microbatches, self.targets.shape[0])
                # said only of a configuration the batch can take: refused here, nothing is traced
                self.note(f"tracing every pipeline rank's program of {mesh} ({', '.join(how)})")
                group = Target.of(degrees, self.precision, self.sequence_parallel, self.moe_capacity_factor).group(PP)
                assert group is not None  # a pipeline mesh
                made = pipeline_programs(
                    self.recording(degrees.get(EP, 1)),
                    self.layout(dp, fsdp, degrees.get(TP, 1), degrees.get(EP, 1)),
                    Schedule(group, microbatches, schedule, virtual, recompute),
                    reporting=Reporting(trying=lambda line: self.note(f"{mesh} ({', '.join(how)}): {line}")),
                    compute=self._compute,
                    passes=PassOptions(),  # the build's default options
                    memory_limit=self.memory_limit.bytes if self.memory_limit is not None else None,
                    # the layout's microbatch forward, traced once for every schedule priced on it
                    forwards=self._forwards.setdefault((dp, fsdp, degrees.get(TP, 1)), {}),
                )
            except AotError as e:
                raise Unsupported(str(e)) from None
            self.pipelines[key] = ([c.graph for c in made.captures], [analyze(c.graph, c.slots) for c in made.captures])
            self.seconds["pipelines"] += time.perf_counter() - started
        return self.pipelines[key]

    def pipeline_holdings(self, fsdp: int, tp: int, ep: int = 1) -> PipelineHoldings:
        """What the pipeline ranks of a mesh (fsdp, tp, ep) hold at the least
        (aot.plan.pipeline_floor.holdings_of), the model's backward reads found once. Unsupported
        where the build refuses the layout."""
        from aot.capture.backward_reads import parameters_read_in_backward

        if (fsdp, tp, ep) not in self._floors:  # the search asks it of every pipeline mesh
            if self._backward_reads is False:  # found on the model cut to 3 blocks where it has them (repeated_blocks.widened_reads)
                rec = self.rec if self.blocks is None else self._cut_recording()
                reads = parameters_read_in_backward(self.mf, rec.state, rec.inputs, rec.targets)
                self._backward_reads = reads if reads is None or self.blocks is None else widened_reads(reads, *self.blocks)
            reads = None if isinstance(self._backward_reads, bool) else self._backward_reads
            layouts = (self.layout(1, 1, tp, ep), self.layout(1, fsdp, tp, ep))
            # (a stacked experts weight is not among the plain model's reads: counted as freed early, a lower floor)
            self._floors[(fsdp, tp, ep)] = holdings_of(self.recording(ep).state, *layouts, self.precision, reads)
        return self._floors[(fsdp, tp, ep)]

    def _degrees(self, axes: tuple, shape: tuple) -> tuple[int, int, int, int]:
        degrees = dict(zip(axes, shape))
        other = [a for a, d in degrees.items() if a not in (DP, FSDP, TP, EP) and d > 1]
        if other:
            raise Unsupported(f"no graph for axes {', '.join(other)} yet (priced once the build captures them)")
        dp, fsdp, tp, ep = degrees.get(DP, 1), degrees.get(FSDP, 1), degrees.get(TP, 1), degrees.get(EP, 1)
        if tp > 1 or ep > 1:
            self._local_numels(tp, ep)  # Unsupported here, before any trace, where the build would refuse tp or ep
        return dp, fsdp, tp, ep

    def _local_numels(self, tp: int, ep: int) -> list[int]:
        """Each parameter's numel on one rank of a tp x ep layout before fsdp sharding (what
        `_derive` rescales shards from), once per (tp, ep): the search asks for every mesh it
        prices, and the layout walks every module of the model (Llama-3-70B: 10 ms). Unsupported
        where the build refuses the layout."""
        if (tp, ep) not in self._numels:
            self._numels[(tp, ep)] = [s.numel() for s in self.layout(1, 1, tp, ep).local_shapes(self.recording(ep).state).values()]
        return self._numels[(tp, ep)]

    def _derive(self, base: StepGraph, source: tuple, dp: int, fsdp: int, tp: int, ep: int = 1) -> StepGraph:
        """The graph of mesh (dp, fsdp, tp[, ep]) from `base`, the graph of its traced mesh `source`."""
        from aot.plan.derived_steps import drop_group, rescale, shard_scale

        if fsdp == 1:
            return base
        graph = base if dp > 1 or source[0] == 1 else drop_group(base, group_name(DP))
        if fsdp == 2:
            return graph
        return rescale(graph, shard_scale(self._local_numels(tp, ep), 2, fsdp), group_name(FSDP), fsdp)
