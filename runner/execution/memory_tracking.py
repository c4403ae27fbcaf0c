"""The measured peak memory of one training step on one rank (`aot run --profile`).

It counts what the plan's memory prediction counts (aot/plan/cost_model.py): the program's inputs
(parameters, buffers, optimizer state, learning rates, loss-scaling state, the batch), once per
storage, plus every storage the program creates, from the op that creates it until it is freed;
the peak is the largest sum over the step.

- CPU, portable program: a TorchDispatchMode sees every aten op the FX program runs. Each storage
  an op returns is counted once (a view of a counted storage adds nothing) and un-counted when its
  memory is freed: a weak reference to the storage says so exactly (its refcount reached zero),
  whichever Python or C++ object held it last. The program's generated code drops each value
  after its last use, so storages die where the plan's intervals end. The dead are collected
  before each op and the total sampled after it, when its outputs exist and its inputs are still
  held: the point the plan's intervals (inclusive at both ends) count too. A collective's buffer
  is waited for until gloo's worker thread lets go of it (`_until_collective_lets_go`).
- CPU, compiled tier: its kernels run inside the package, where no dispatch mode sees them. The
  CPU allocator's own events (torch.profiler, profile_memory) count every allocation and free of
  the step in order; the peak of their running sum, plus the inputs, is the same quantity (checked
  against the dispatch mode on portable programs: equal to within a few bytes of kernels' scratch).
  The profiler is used for this tier alone: it cannot run inside the timeline's profiler
  (runner/execution/profiling.py starts that one after this step), and its private event tree may change
  between torch releases (then: not measured, rather than a wrong number).
- CUDA: `torch.cuda.max_memory_allocated` over the step, after resetting the peak: everything
  allocated on the device, which is what the prediction must fit into there.
"""

from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TRACKED = "live tensor bytes (dispatch-mode tracking)"
ALLOCATOR = "live tensor bytes (CPU allocator events, torch.profiler)"
CUDA = "torch.cuda.max_memory_allocated"
NOT_MEASURED = "not measured (this torch's profiler gives no allocation events)"


def method(device: torch.device, tier: str) -> str:
    """How a step of `tier` on `device` is measured: TRACKED, ALLOCATOR or CUDA."""
    if device.type == "cuda":
        return CUDA
    return ALLOCATOR if tier == "compiled" else TRACKED


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes(inputs) as live: program(*inputs)`; then `live.peak` is the most bytes held
    at once. `inputs` are counted for the whole time (their owner holds them); storages ops create
    are counted while they are alive."""

    def __init__(self, inputs=()):
        super().__init__()
        self.resident = 0  # bytes of the inputs, each storage once
        self._inputs: set = set()  # their storages
        self._made: dict = {}  # storage made by an op -> its bytes
        self.live = 0  # bytes of self._made now
        self.peak = 0
        for t in inputs:
            self.hold(t)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable by default, which
        # imports torch._dynamo on the first op: 1.5 s of a run's start-up. Nothing is compiled
        # under this mode (it watches an FX program run eagerly), so there is nothing to disable.
        return False

    def hold(self, t) -> None:
        """Count `t`'s storage as resident: held by the caller for the whole step."""
        if not _counted(t):
            return
        key = StorageWeakRef(t.untyped_storage())
        if key not in self._inputs:
            self._inputs.add(key)
            # The tensor's own bytes, not its storage's, as the prediction counts an input: a batch
            # may be a slice of a larger tensor, which is not the step's memory.
            self.resident += t.numel() * t.element_size()
            self.peak = max(self.peak, self.resident + self.live)

    def __exit__(self, *exc):
        self._collect()
        return super().__exit__(*exc)

    def _collect(self) -> None:
        dead = [key for key in self._made if key.expired()]
        for key in dead:
            self.live -= self._made.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._collect()
        for t in tree_leaves((args, kwargs)):
            # A tensor no op made and no one declared (a constant the module holds) is resident.
            if _counted(t) and StorageWeakRef(t.untyped_storage()) not in self._made:
                self.hold(t)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not _counted(t):
                continue
            key = StorageWeakRef(t.untyped_storage())
            if key in self._inputs:
                continue  # an in-place op on an input, or a view of one
            size = t.untyped_storage().nbytes()
            # A storage seen before adds nothing, unless an op resized it in place.
            self.live += size - self._made.get(key, 0)
            self._made[key] = size
        if func is _WAIT:
            _until_collective_lets_go(out)
        self.peak = max(self.peak, self.resident + self.live)
        return out


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _until_collective_lets_go(t: torch.Tensor, limit_s: float = 0.01) -> None:
    """Wait (at most `limit_s`) until only the program holds a collective's waited result.

    gloo's worker thread completes a collective, wakes the waiter, and drops its own reference to
    the buffer a moment later. That moment races the program's next ops: about half the measured
    steps of a 2-rank dp MLP counted its 27 KiB gradient bucket past its last use (a quarter of
    the step's peak). Only the measured step waits here, for microseconds; the program's
    reference is the Python tensor's one."""
    deadline = time.perf_counter() + limit_s
    # Tensor._use_count (the C++ reference count) exists at runtime; torch's stubs do not declare it
    while t._use_count() > 1 and time.perf_counter() < deadline:  # type: ignore[attr-defined]
        time.sleep(0)


def _counted(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta"


def measure_step(run, args: list, device: torch.device, tier: str):
    """Run `run(*args)` (one step of the program) and measure its peak: (outputs, (peak bytes or
    None, the method used))."""
    how = method(device, tier)
    if how == CUDA:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        outputs = run(*args)
        torch.cuda.synchronize(device)
        return outputs, (int(torch.cuda.max_memory_allocated(device)), how)
    if how == ALLOCATOR:
        return _allocator_peak(run, args)
    with LiveBytes(args) as live:
        outputs = run(*args)
    return outputs, (live.peak, how)


def _allocator_peak(run, args: list):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outputs = run(*args)
    try:
        sizes = sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree()))
    except AttributeError:  # a torch without the event tree this reads
        return outputs, (None, NOT_MEASURED)
    live = peak = 0
    for _, size in sizes:  # frees are negative sizes
        live += size
        peak = max(peak, live)
    return outputs, (LiveBytes(args).resident + peak, ALLOCATOR)


def _allocations(nodes):
    """(time, bytes) of every allocation (positive) and free (negative) under `nodes`."""
    kind = torch._C._profiler._EventType.Allocation
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.tag == kind:
            yield node.start_time_ns, node.extra_fields.alloc_size
        stack.extend(node.children)
