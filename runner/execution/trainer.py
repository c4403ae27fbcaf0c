"""The training runtime: one rank's program, its state and its step, with no model code.

`Trainer` verifies and loads its rank's files, binds the process groups the program names, and
runs the whole-step program: forward, loss, backward, collectives and optimizer update happen
inside it, and parameters, buffers and optimizer state are updated in place.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from runner.format.artifact import TORCH_SKEW_FLAG, TORCH_SKEW_RISK, Artifact
from runner.format.axes import PP
from runner.format.checkpoint import commit_checkpoint, last_good, layout_of, load_checkpoint, optimizer_key, remove_shard, write_shard
from runner.execution.compiled import CompiledProgram, choose_tier, live_device, load_compiled
from runner.execution.custom_ops import import_op_libraries
from runner.execution.data import DataSource, data_rank_of, describe, dtype_name, split_batch_tensors
from runner.execution.evaluation import NO_EVAL_PROGRAM
from runner.errors import AotError
from runner.execution.replica_check import check_replicas
from runner.execution.groups import bind_process_groups, yield_gloo_poll_threads
from runner.execution.graph_loader import input_shapes, load_portable, uses_batch, wait_at_issue
from runner.execution.init_from import check_init_from
from runner.execution.init_program import SCALER_PREFIX, initial_state, stage_tensors
from runner.execution.launch import Launch, resolve_launch
from runner.execution.cuda_graphs import GraphedStep, graphs_refused, resolve_graphs
from runner.execution.launched_step import LaunchedStep, StepTiming
from runner.execution.log import RankLogger
from runner.execution.memory_tracking import measure_step
from runner.execution.p2p import failed_transfer, forget_waits, install_kernels
from runner.hardware.binding import bind_rank
from runner.format.sharding import join_tp_slices, shard_number, tp_fused, tp_slice_shape, unshard
from runner.format.stacked import held_names, model_tensors
from runner.hardware.topology_check import verify_live


def step_seed(seed: int, step: int, data_rank: int) -> int:
    """The global RNG seed of one step (artifacts/FORMAT.md, "Randomness"): dropout and any other
    random op in the program draw from it. It depends on the build's seed, the step and the data
    rank only, so tensor-parallel ranks (same data) draw the same masks for their replicated
    activations, data-parallel ranks draw different ones, and a resumed run draws what an
    uninterrupted one would have."""
    return ((seed * 1_000_003 + step) * 1_009 + data_rank) % 2**63


def seed_step(device: torch.device, seed: int) -> None:
    """Seed the generators a program's random ops draw from on `device`: the CPU's, and the
    device's own on CUDA; the same values `torch.manual_seed(seed)` gives them. That call also
    seeds every other backend torch knows, and where CUDA is not initialized (CPU ranks) it queues
    the CUDA seeding with a formatted stack trace (torch.cuda._lazy_call), which reads source
    files: 0.3 ms a step here, a third of a small model's CPU step. These take microseconds."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)


def nccl_algorithm(manifest: dict, environ, log=lambda msg: None) -> str | None:
    """Apply the planned NCCL algorithms (manifest plan.nccl_algo, an NCCL_ALGO value such as
    "allreduce:tree") before NCCL starts, unless the user already set NCCL_ALGO, which wins.
    Returns the value in effect."""
    planned = (manifest.get("plan") or {}).get("nccl_algo")
    if environ.get("NCCL_ALGO"):
        if planned and environ["NCCL_ALGO"] != planned:
            log(f"NCCL_ALGO={environ['NCCL_ALGO']} from the environment (the plan assumed {planned})")
        return environ["NCCL_ALGO"]
    if planned:
        environ["NCCL_ALGO"] = planned
        log(f"NCCL_ALGO={planned} (from the artifact's plan)")
    return planned


class Trainer:
    """One rank of a built training job.

    `step(inputs, targets)` runs one training step and returns the global-batch loss (the mean
    of the data-parallel ranks' losses). `state_dict()` and `save(dir)` give the training state
    under the user's parameter names. `tier` picks the program (runner/execution/compiled.py); when a
    compiled package is passed over, rank 0 gives `notice` its one-line reason (also kept as
    `tier_notice`) before the process group starts. `cuda_graphs` ("auto", "on", "off"): whether
    the step runs as one CUDA graph (runner/execution/cuda_graphs.py). `warn`, `log` and `notice` take one line each;
    not given, the lines go to the `aot` logger with the rank (runner/execution/log.py).
    """

    def __init__(
        self,
        path: str | Path,
        rank: int | None = None,
        *,
        world_size: int | None = None,
        device: str | torch.device | None = None,
        allow_topology_mismatch: bool = False,
        allow_torch_skew: bool = False,
        trusted_keys: list[str] | None = None,
        timeout_s: float = 600,
        bind: bool = True,
        warn=None,
        log=None,
        tier: str = "auto",
        notice=None,
        init_from: str | Path | None = None,
        launch: Launch | None = None,
        evaluates: bool = False,
        data_files: tuple = (),
        cuda_graphs: str = "off",
    ):
        self.artifact = artifact = Artifact(path, trusted_keys, torch_skew=allow_torch_skew)
        manifest = artifact.manifest
        if artifact.torch_skew and warn is not None:
            warn(f"{path}: built with torch {manifest['torch_version']}, run with torch {torch.__version__} ({TORCH_SKEW_FLAG}): {TORCH_SKEW_RISK}")
        # how this process was started (runner.execution.launch): torchrun's variables, Slurm's, or `aot run
        # --rank/--world-size`, which the command line has exported as torchrun's
        launch = launch if launch is not None else resolve_launch()
        self.rank = rank if rank is not None else launch.rank
        self.world_size = world_size if world_size is not None else launch.world_size
        self.local_rank = launch.local_rank
        if self.world_size != artifact.world_size:
            raise AotError(
                f"{artifact.root}: built for world size {artifact.world_size} but this job has "
                f"{self.world_size} process(es); {launch.relaunch_hint(artifact.world_size)} "
                f"or rebuild with --world-size {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise AotError(f"rank {self.rank} is outside world size {self.world_size}")
        # messages the caller does not take go to the `aot` logger (runner/execution/log.py), tagged with the rank
        logger = RankLogger(self.rank, self.world_size)
        warn = warn or logger.warning
        log = log or logger.info
        notice = notice or logger.warning

        # The topology contract is checked before any collective can hang on the wrong fabric.
        # Raises runner.hardware.topology_check.TopologyMismatch (an AotError) with one line per mismatch class.
        profile = manifest["topology"]["profile"]
        verify_live(profile, allow_mismatch=allow_topology_mismatch, warn=warn)

        self.device = torch.device(device) if device else self._default_device(profile, self.local_rank)
        # The CPU cores and memory node nearest this rank's GPU, before the process group starts its
        # threads and before the tier check below asks CUDA for the GPU's compute capability.
        self._log = log
        # --cuda-graphs on where no graph can be captured fails here, before any process group
        resolve_graphs(cuda_graphs, graphs_refused(self.device, bool(manifest.get("pipeline")), host_collectives=False))
        self.binding = bind_rank(self.device, enabled=bind, log=log)
        entry = artifact.rank(self.rank)
        if evaluates and entry.get("eval_program") is None:  # before any process group: every rank refuses alike
            raise AotError(f"{artifact.root}: this artifact {NO_EVAL_PROGRAM}")
        # The compiled tier (an AOTInductor package, runner/execution/compiled.py) where the artifact has one
        # for this run's device kind and torch; else the portable program every artifact has, and
        # `tier_notice` says why when a package was passed over (given to `notice` once, by rank 0).
        # `tier` ("auto", "compiled", "portable") is the caller's wish; self.tier is what runs.
        # Decided from the manifest and this machine alone, before any process group starts, so
        # `--tier compiled` on a machine the package is not for fails at once, in one line.
        self.tier, self.tier_notice = choose_tier(manifest.get("compiled"), entry["program"], live_device(self.device), tier, str(artifact.root))
        if self.tier_notice and self.rank == 0:
            notice(self.tier_notice)
        # The user's weights (`init_from`) are checked against the manifest from their headers
        # alone, before any process group starts, so a wrong file fails at once on every rank.
        self.init_from = None
        if init_from is not None:
            self.init_from = check_init_from(init_from, manifest)
            if self.rank == 0:
                for line in self.init_from.notes:
                    notice(line)
        self.data_spec = manifest["data"]
        self.coords = entry["coords"]
        self.data_rank, self.data_size = data_rank_of(manifest["mesh"], self.coords)
        # The data files (`data_files`: (path, token dtype) pairs) opened, their headers and shapes
        # checked, before any process group starts: a bad shard fails at once, in one line per rank.
        self._opened = {(str(path), dtype): DataSource.from_file(path, self.data_spec, self.data_rank, self.data_size, dtype) for path, dtype in data_files}
        self.timeout_s = timeout_s
        self._init_distributed(profile)
        self.groups = bind_process_groups(manifest["process_groups"], self.rank, self.world_size)
        if self.on_gloo():
            yield_gloo_poll_threads()

        program = artifact.program(entry["program"])
        import_op_libraries(manifest)  # the program's custom operators resolve only once their module is imported
        self.collectives_waited_at_issue = False
        program_json = artifact.read(program["file"])
        self._input_shapes = input_shapes(program_json)  # what the program was traced for, to check bindings
        self._module: CompiledProgram | torch.fx.GraphModule
        if self.tier == "compiled":
            self._module = load_compiled(artifact, entry["program"], self.device, len(program["inputs"]))
            self.program_loader = "aoti"
        else:
            portable, self.program_loader = load_portable(artifact, program, self.device, program_json)
            self._module = portable
            # On gloo, one collective in flight at a time (runner.execution.graph_loader.wait_at_issue says
            # why); NCCL keeps the program's overlap of communication with compute. The compiled
            # tier's schedule is fixed inside its package and is left as built.
            self.collectives_waited_at_issue = self.on_gloo()
            if self.collectives_waited_at_issue:
                wait_at_issue(portable)
        if manifest.get("pipeline"):  # the program sends to and receives from other stages
            install_kernels()
        # A program that uses no tensor of the batch (a pipeline's middle stages) reads no data; the
        # compiled tier's package does not show its graph, and reads.
        self.reads_batch = not isinstance(self._module, torch.fx.GraphModule) or uses_batch(self._module, program["inputs"])

        self.state_spec = manifest["state"]
        weights, optimizer = self._initial_state(entry)
        self._weights = {k: self._place(v) for k, v in weights.items()}
        self._optimizer = {k: self._place(v) for k, v in optimizer.items()}

        self.sharding = manifest.get("sharding")
        self.tensor_parallel = manifest.get("tensor_parallel")
        pipeline = manifest.get("pipeline")
        # the checkpoint's view of the pipeline: each stage's ranks write their own shards
        self.pipeline = {"axis": pipeline["axis"], "size": pipeline["size"]} if pipeline else None
        self.expert_parallel = manifest.get("expert_parallel")
        self.shard_index = shard_number(self.coords, self.sharding, self.tensor_parallel, self.pipeline, self.expert_parallel)
        self.schedule = manifest["schedule"]
        self.seed = int(manifest["build"].get("seed", 0))
        self._slots = program["inputs"]
        self._outputs = list(program["outputs"])
        # Whole-step CUDA graphs (runner/execution/cuda_graphs.py): the learning rates are then
        # device scalars, filled in place, since a graph reads a CPU scalar once, at capture.
        graphed = resolve_graphs(cuda_graphs, graphs_refused(self.device, pipeline is not None, self.on_gloo()))
        # A varying schedule under fp16 loss scaling stands where the applied updates say, a count
        # on the device: the schedule is then a device table its rates are picked from, so the
        # host never reads the count back (the learning rates live on the device too).
        self._lr_table = self._schedule_on_device()
        on_device = graphed or self._lr_table is not None
        self._lrs = [torch.zeros((), dtype=torch.float64, device=self.device if on_device else "cpu") for _ in range(len(self.schedule["lr"][0]))]
        self._check_bindings()
        self._args = [self._bind(slot) for slot in self._slots]
        self._check_shapes()
        batch = [i for i, slot in enumerate(self._slots) if slot["kind"] in ("input", "target")]
        self._run = GraphedStep(self._module, batch, log) if graphed else self._module
        self.step_index = 0
        self.last_step_skipped = False
        self.measured_peak_bytes: int | None = None  # of the last step run with measure_memory
        self.memory_method: str | None = None  # how it was measured

    # -- set-up ---------------------------------------------------------------------------
    @staticmethod
    def _default_device(profile: dict, local_rank: int) -> torch.device:
        if profile["device_kind"] == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def _initial_state(self, entry: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """This rank's weights and optimizer state before the first step: its pieces of the user's
        weights (`init_from`) or of the init program's, and the optimizer state (with fp16's loss
        scaling state) the manifest describes."""
        artifact, manifest = self.artifact, self.artifact.manifest
        self.weights_source = str(self.init_from.path) if self.init_from else f"the init program (seed {manifest['build'].get('seed', 0)})"
        return initial_state(artifact, entry["coords"], self.init_from, self.device)

    def _init_distributed(self, profile: dict) -> None:
        if dist.is_initialized():
            return
        if self.world_size == 1 and not self.artifact.manifest["process_groups"]:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            nccl_algorithm(self.artifact.manifest, os.environ, self._log)
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            raise AotError(
                "no rendezvous set: launch multi-rank artifacts with torchrun, or give each process "
                "--master-addr and --master-port (MASTER_ADDR and MASTER_PORT under srun)"
            )
        # torchrun restarts a failed group against the same store: keys of the dead attempt
        # (peers' old addresses) would be read as live ones, so each attempt gets its own prefix.
        store, _, _ = next(dist.rendezvous("env://", self.rank, self.world_size, timeout=timedelta(seconds=self.timeout_s)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"aot/attempt-{attempt}/", store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.timeout_s),
            device_id=self.device if backend == "nccl" else None,
        )  # gloo: none, as torch defaults

    def on_gloo(self) -> bool:
        """Whether this rank's collectives (on tensors of its device) go through gloo."""
        if not dist.is_initialized():
            return False
        world = dist.group.WORLD
        assert world is not None  # set by init_process_group (dist.is_initialized() above)
        try:
            return isinstance(world._get_backend(self.device), dist.ProcessGroupGloo)
        except RuntimeError:  # no backend registered for this device
            return False

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        # Zero-dim state (Adam's step counter) stays on the CPU as torch.optim keeps it, so
        # reading it as a Python number inside the program never synchronizes the device.
        return t if t.dim() == 0 else t.to(self.device)

    def _check_bindings(self) -> None:
        """Every tensor the program's inputs name must exist in the rank's files, and the schedule
        must give each optimizer group a learning rate: checked once, before the first step."""
        where = f"{self.artifact.root}/manifest.json"
        n_groups = len(self._lrs)
        inputs = sum(1 for s in self._slots if s["kind"] == "input")
        for slot in self._slots:
            kind = slot["kind"]
            if kind in ("param", "buffer") and slot["name"] not in self._weights:
                raise AotError(f"{where}: the program takes {kind} {slot['name']!r}, which the weights file lacks")
            if kind == "optim" and optimizer_key(slot["name"], slot["key"]) not in self._optimizer:
                raise AotError(f"{where}: the program takes optimizer state {slot['name']}:{slot['key']}, which the optimizer file lacks")
            if kind == "scaler" and SCALER_PREFIX + slot["key"] not in self._optimizer:
                raise AotError(f"{where}: the program takes loss-scaling state {slot['key']!r}, which the optimizer state lacks")
            if kind == "lr" and not 0 <= slot["group"] < n_groups:
                raise AotError(f"{where}: the program takes a learning rate for group {slot['group']}, the schedule has {n_groups}")
            if kind == "input" and not 0 <= slot["index"] < inputs:
                raise AotError(f"{where}: program input index {slot['index']} out of range")
        if any(len(step) != n_groups for step in self.schedule["lr"]):
            raise AotError(f"{where}: schedule.lr steps do not all give {n_groups} learning rate(s)")
        held = stage_tensors(self.artifact.manifest, self.coords)  # a pipeline rank: its stages' tensors
        for name in sorted(held_names(self.state_spec)):
            if name not in self._weights and (held is None or name in held):
                raise AotError(f"{where}: the state_dict's tensor {name!r} is not stored")
        if [s["kind"] for s in self._slots].count("target") != 1:
            raise AotError(f"{where}: the program must take exactly one targets input")

    def _check_shapes(self) -> None:
        """Each tensor bound to the program has the shape the program was traced for: a damaged
        manifest (or a wrong state description) fails here, in one line, not inside a step."""
        for index, (slot, tensor) in enumerate(zip(self._slots, self._args)):
            if tensor is None or self._input_shapes is None or slot["kind"] not in ("param", "buffer", "optim"):
                continue
            want = self._input_shapes[index]
            if want is not None and list(tensor.shape) != want:
                what = f"{slot['name']}:{slot['key']}" if slot["kind"] == "optim" else slot["name"]
                raise AotError(
                    f"{self.artifact.root}: the program takes {slot['kind']} {what} of shape {want}, {self.weights_source} gives {list(tensor.shape)}"
                )

    def _bind(self, slot: dict):
        kind = slot["kind"]
        if kind in ("param", "buffer"):
            return self._weights[slot["name"]]
        if kind == "optim":
            return self._optimizer[optimizer_key(slot["name"], slot["key"])]
        if kind == "lr":
            return self._lrs[slot["group"]]
        if kind == "scaler":
            return self._optimizer[SCALER_PREFIX + slot["key"]]
        return None  # inputs and targets arrive with each step

    # -- training -------------------------------------------------------------------------
    def learning_rates(self, step: int) -> list[float]:
        lrs = self.schedule["lr"]
        if self.schedule["constant"]:
            return lrs[0]
        if step >= len(lrs):
            raise AotError(f"the artifact's learning-rate schedule covers {len(lrs)} steps; step {step + 1} is past it (rebuild with a larger --max-steps)")
        return lrs[step]

    def check_steps(self, steps: int) -> None:
        """Refuse up front a run that would go past the stored learning-rate schedule."""
        if steps > 0:
            self.learning_rates(self.optimizer_steps + steps - 1)

    @property
    def optimizer_steps(self) -> int:
        """Steps whose update was applied: the schedule's position. fp16 loss scaling skips the
        update on overflow, and the schedule waits, as a loop calling scheduler.step() only after
        an optimizer step that ran does."""
        skipped = self._optimizer.get(SCALER_PREFIX + "skipped_steps")
        return self.step_index - (int(skipped.item()) if skipped is not None else 0)

    def _schedule_on_device(self) -> torch.Tensor | None:
        """The varying schedule as a [steps, groups] table on the device, where fp16 loss scaling
        keeps the count of skipped updates (None otherwise: the position is the step index)."""
        if self.schedule["constant"] or SCALER_PREFIX + "skipped_steps" not in self._optimizer:
            return None
        return torch.tensor(self.schedule["lr"], dtype=torch.float64, device=self.device)

    def _fill_learning_rates(self) -> None:
        """This step's learning rates into the program's inputs, read from nothing on the device:
        under fp16 the schedule's position (steps less skipped updates) selects a row of the
        device table. It is at most the step index, so only a run past the table's end (possible
        only where updates were skipped) reads the count, to tell a step still inside it from one
        past it."""
        table = self._lr_table
        if table is None or self.step_index >= len(table):
            rates = self.schedule["lr"][0] if self.schedule["constant"] else self.learning_rates(self.optimizer_steps)
            for lr, value in zip(self._lrs, rates):
                lr.fill_(value)
            return
        skipped = self._optimizer[SCALER_PREFIX + "skipped_steps"]
        row = table.index_select(0, (self.step_index - skipped).reshape(1))[0]
        for group, lr in enumerate(self._lrs):
            lr.copy_(row[group])

    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None without loss scaling)."""
        scale = self._optimizer.get(SCALER_PREFIX + "scale")
        return float(scale.item()) if scale is not None else None

    def launch(self, inputs, targets, measure_memory: bool = False) -> "LaunchedStep":
        """Queue one step and return without reading its results back: on a GPU the host can queue
        the next step while this one runs, and nothing in here waits for the device (the learning
        rates are host numbers, or under fp16 a row of the schedule picked on the device by the
        count of skipped updates). Read the results from the
        returned LaunchedStep, in step order. `measure_memory`: also measure this step's peak
        memory (runner/execution/memory_tracking.py; slower, so never a timed step) into
        `measured_peak_bytes` (None where it cannot be measured) and how into `memory_method`."""
        timing = StepTiming(self.device)
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        self._fill_learning_rates()
        given = iter(inputs)
        args = list(self._args)
        for i, slot in enumerate(self._slots):
            if slot["kind"] == "input":
                args[i] = self.check_input(next(given, None), slot, f"inputs[{slot['index']}]")
            elif slot["kind"] == "target":
                args[i] = self.check_input(targets, slot, "targets")
        seed_step(self.device, step_seed(self.seed, self.step_index, self.data_rank))
        forget_waits()
        try:
            if measure_memory:
                outputs, (self.measured_peak_bytes, self.memory_method) = measure_step(self._module, args, self.device, self.tier)
            else:
                outputs = self._run(*args)
        except RuntimeError as e:
            raise self.stuck_error(e) from e
        timing.stop()
        self.step_index += 1
        # the loss scale after this step, kept before the next step updates it in place
        scale = self._optimizer.get(SCALER_PREFIX + "scale")
        kept = scale.clone() if scale is not None else None
        return LaunchedStep(self, self.step_index, outputs[1], self._output(outputs, "found_inf"), kept, timing, self._output(outputs, "moe_dropped"))

    def _output(self, outputs, name: str):
        """The program's output `name` (artifacts/FORMAT.md, "Program outputs"), or None where it has
        none: fp16's found_inf (where set, the update was skipped; a version-6 manifest does not
        list it, its third output is it), expert parallelism's dropped choices."""
        if name in self._outputs:
            return outputs[self._outputs.index(name)]
        legacy = name == "found_inf" and len(self._outputs) == 2 and len(outputs) > 2
        return outputs[2] if legacy else None

    def step(self, inputs, targets, measure_memory: bool = False) -> float:
        """One step, its loss read back (a host sync; `aot run`'s loop uses `launch`)."""
        launched = self.launch(inputs, targets, measure_memory)
        loss = launched.loss()
        self.last_step_skipped = launched.skipped()
        return loss

    def stuck_error(self, e: RuntimeError) -> Exception:
        """A pipeline transfer that failed or timed out as one line naming it (runner/execution/p2p.py
        knows which), a collective's timeout as one line naming the collectives; other errors as
        they are."""
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        failed = failed_transfer(e, timed_out, self.timeout_s)
        if failed is not None:
            return AotError(f"step {self.step_index + 1}: pipeline rank {self.coords.get(PP, 0)} {failed}")
        if not timed_out and "closed by peer" in str(e).lower():
            return AotError(f"step {self.step_index + 1}: {self._collectives()} lost the link to another rank; it stopped (its own error says why) or crashed")
        if not timed_out:
            return e
        return AotError(
            f"step {self.step_index + 1}: {self._collectives()} did not complete within "
            f"{self.timeout_s:g} s; a rank is stuck or gone ({str(e).strip().splitlines()[0]})"
        )

    def _collectives(self) -> str:
        """The collectives of this rank's program and their groups, for error messages."""
        program = self.artifact.program(self.artifact.rank(self.rank)["program"])
        kinds = sorted({f"{c['kind']} over {c['group']} (ranks {self.groups.get(c['group'], ('?',))[0]})" for c in program["collectives"]})
        return "collective " + ", ".join(kinds) if kinds else "a collective"

    def check_input(self, tensor, slot: dict, name: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise AotError(f"{name}: expected a tensor {describe(slot['shape'], slot['dtype'])}, got {type(tensor).__name__}")
        if list(tensor.shape) != slot["shape"] or dtype_name(tensor.dtype) != slot["dtype"]:
            raise AotError(f"{name}: expected {describe(slot['shape'], slot['dtype'])}, got {describe(tensor.shape, dtype_name(tensor.dtype))}")
        return tensor.to(self.device, non_blocking=True)  # queued behind the step before, no wait for it (a GPU's)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by name (its pieces), the tensors steps update in place."""
        return self._weights

    # -- data -----------------------------------------------------------------------------
    def data_source(self, path: str | Path | None = None, token_dtype: str | None = None, shuffle: int | None = None) -> DataSource:
        """--data's rows for this rank (a file, folder or glob of shards: runner/execution/data.py), or the
        artifact's recorded example batch; `shuffle`: --shuffle's seed (every epoch in its order)."""
        if path is not None:
            source = self._opened.pop((str(path), token_dtype), None) or DataSource.from_file(path, self.data_spec, self.data_rank, self.data_size, token_dtype)
            if not self.reads_batch:
                self._log(f"pipeline rank {self.coords.get(PP, 0)}'s program takes no inputs or targets: it reads no data")
                return source.unread()
            return source.shuffle_with(shuffle) if shuffle is not None else source
        example = self.artifact.tensors(self.data_spec["example"])
        inputs, targets = split_batch_tensors(example, self.data_spec["example"])
        source = DataSource(inputs, targets, self.data_spec, self.data_rank, self.data_size, "example batch")
        return source.shuffle_with(shuffle) if shuffle is not None else source

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict as the user's model would return it (tied weights under every
        name); a pipeline rank's holds its stages' tensors only. With sharded parameters this
        all-gathers them: every rank must call it."""
        return model_tensors(self._full_weights(), self.state_spec)

    def _full_weights(self) -> dict[str, torch.Tensor]:
        full = dict(self._weights)
        tp, ep = self.tensor_parallel or {}, self.expert_parallel or {}
        dims, experts = tp.get("params", {}), set(ep.get("params", []))
        if self.sharding:  # fsdp pieces -> this rank's tensor-parallel slice (or the whole tensor)
            _, group = self.groups[self.sharding["group"]]
            for name in self.sharding["params"]:
                if name not in self._weights:  # another pipeline stage's
                    continue
                piece = self._weights[name]
                gathered = torch.empty(piece.numel() * self.sharding["size"], dtype=piece.dtype, device=piece.device)
                dist.all_gather_into_tensor(gathered, piece.contiguous(), group=group)
                shape = tp_slice_shape(self.state_spec["params"][name][0], dims.get(name), tp.get("size", 1))
                if name in experts:
                    shape = tp_slice_shape(shape, 0, ep["size"])
                full[name] = unshard([gathered], shape)
        if ep:  # expert-parallel slices -> every expert
            _, group = self.groups[ep["group"]]
            for name in (n for n in ep["params"] if n in full):  # the manifest's order: every rank gathers alike
                slices = [torch.empty_like(full[name]) for _ in range(ep["size"])]
                dist.all_gather(slices, full[name].contiguous(), group=group)
                full[name] = torch.cat(slices, 0)
        if tp:  # tensor-parallel slices -> whole tensors
            _, group = self.groups[tp["group"]]
            for name, dim in dims.items():
                if name not in full:
                    continue
                slices = [torch.empty_like(full[name]) for _ in range(tp["size"])]
                dist.all_gather(slices, full[name].contiguous(), group=group)
                full[name] = join_tp_slices(slices, dim, tp_fused(tp, name))
        return full

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state (its shard when sharded)."""
        return dict(self._optimizer)

    def check_replicas(self, when: str) -> None:
        """Every tensor several ranks hold a copy of is the same on each (runner/execution/replica_check.py);
        AotError naming the first that is not. Every rank must call it."""
        check_replicas(self, when)

    def save(self, folder: str | Path, target_step: int | None = None, data_order: dict | None = None) -> None:
        """Checkpoint: one replica of each shard writes its files, then rank 0 commits the index.
        Every rank must call it. The replicas are compared first: a checkpoint of ranks that
        diverged would be one rank's guess, and the last good one stays. `data_order`: how the
        run orders its data ({"shuffle": seed or None}), which a resume must repeat."""
        self.check_replicas(f"before saving step {self.step_index}")
        split_by = {spec["axis"] for spec in (self.sharding, self.tensor_parallel, self.pipeline, self.expert_parallel) if spec}
        writes = all(v == 0 for axis, v in self.coords.items() if axis not in split_by)
        step, sharded = self.step_index, bool(split_by)
        # A write that fails (a full disk, a file-size limit) fails the save on every rank alike:
        # the ranks agree before the index is committed, and again after, so none goes on with a
        # checkpoint that is not there; the new files are removed, the last good checkpoint stays.
        problem = None
        if writes:
            try:
                write_shard(folder, step, self.shard_index, sharded, self._weights, self._optimizer)
            except OSError as e:
                problem = e.strerror or str(e)
        if self._every_rank(problem is None) and self.rank == 0:
            try:
                commit_checkpoint(
                    folder, step, self.state_spec, self.sharding, target_step, self.tensor_parallel, self.pipeline, data_order, self.expert_parallel
                )
            except OSError as e:
                problem = e.strerror or str(e)
        if not self._every_rank(problem is None):
            if writes:
                remove_shard(folder, step, self.shard_index, sharded)
            where = f"({problem})" if problem else "(on another rank)"
            raise AotError(f"{folder}: cannot write the checkpoint of step {step} {where}; {last_good(folder)}")

    def _every_rank(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (an all_reduce MIN over the default group; alone: `ok`)."""
        if not dist.is_initialized():
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)  # NCCL moves device tensors only
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def resume(self, folder: str | Path) -> None:
        index, weights, optimizer = load_checkpoint(folder, self.shard_index)
        if (
            (index.get("sharding") or None) != (self.sharding or None)
            or (index.get("tensor_parallel") or None) != (self.tensor_parallel or None)
            or (index.get("pipeline") or None) != (self.pipeline or None)
            or (index.get("expert_parallel") or None) != (self.expert_parallel or None)
        ):
            raise AotError(f"{folder}: checkpoint was written with another sharding than this artifact's")
        for name, saved, live in (("weights", weights, self._weights), ("optimizer state", optimizer, self._optimizer)):
            if layout_of(saved) != layout_of(live):
                raise AotError(f"{folder}: checkpoint {name} do not match this artifact's tensors (names, shapes or dtypes)")
            with torch.no_grad():
                for key, tensor in saved.items():
                    live[key].copy_(tensor)
        self.step_index = int(index["step"])
