"""Mixed precision: what `--precision` means for the traced step.

`bf16` and `fp16` mean exactly `torch.autocast(device_type=<the target's device kind>, dtype=...)`
around forward and loss, with fp32 master weights and fp32 optimizer state. The autocast policy
(which ops run in the low dtype, which are kept in or upcast to fp32) is the *target's*, not the
build machine's: a build for a CUDA profile traces CUDA's rules even on a CPU-only machine
(call by call, aot/capture/target_autocast.py). `torch.autocast("cuda")` disables itself where no
GPU is present, so for CUDA the autocast state is set directly (`torch.set_autocast_enabled`), as
torch.autocast would set it.

Under fsdp the parameters are all-gathered in the compute dtype and gradients reduce-scattered in
`reduce` (FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype)); data-parallel all_reduces
use `reduce` too. fp16 adds dynamic loss scaling inside the graph (aot/capture/loss_scaling.py).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict, dataclass

import torch

from aot.errors import AotError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The low-precision dtypes each device kind's autocast implements (torch 2.13: CPU autocast takes
# bf16 and fp16, CUDA's both; a device missing from here has no autocast aot can target).
AUTOCAST_DTYPES = {"cpu": ("bf16", "fp16"), "cuda": ("bf16", "fp16")}
# bf16 arithmetic on NVIDIA GPUs needs compute capability 8.0 (A100) or later.
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class GradScalerConfig:
    """torch.amp.GradScaler's constructor arguments, with its defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass(frozen=True)
class Precision:
    compute: str = "fp32"  # fp32 | bf16 | fp16: autocast's dtype (fp32: no autocast)
    rules: str = "cpu"  # whose autocast policy is traced: the target's device kind
    reduce: str = "fp32"  # the dtype gradients are reduced (all_reduce, reduce-scatter) in
    scaler: GradScalerConfig | None = None  # fp16 only: dynamic loss scaling

    @property
    def mixed(self) -> bool:
        return self.compute != "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.compute]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce]

    def autocast(self):
        """The autocast region forward and loss are traced in (nothing for fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        if self.rules == "cpu":
            return torch.autocast("cpu", dtype=self.compute_dtype)
        return _forced_autocast(self.rules, self.compute_dtype)

    def to_json(self) -> dict:
        """The manifest's `precision` entry (artifacts/FORMAT.md, "Precision")."""
        return {
            "compute": self.compute,
            "autocast_rules": self.rules if self.mixed else None,
            "param_dtype": self.compute,
            "reduce_dtype": self.reduce,
            "grad_scaler": asdict(self.scaler) if self.scaler else None,
        }


@contextlib.contextmanager
def _forced_autocast(device: str, dtype: torch.dtype):
    """What torch.autocast(device, dtype) sets on entry and restores on exit, without its check
    that the device is present (the build machine may have no GPU; the tensors are fake)."""
    saved = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device, saved[0])
        torch.set_autocast_dtype(device, saved[1])
        torch.set_autocast_cache_enabled(saved[2])


def _choice(value, names, what: str) -> str:
    if value not in names:
        raise AotError(f"{what} must be one of {', '.join(names)}, got {value!r}")
    return value


def _grad_scaler(value, source: str) -> GradScalerConfig:
    if value is None:
        return GradScalerConfig()
    fields = GradScalerConfig.__dataclass_fields__
    if not isinstance(value, dict) or any(k not in fields for k in value):
        raise AotError(f"{source}: grad_scaler must be a dict of {', '.join(fields)}, got {value!r}")
    config = GradScalerConfig(**value)
    numbers = (config.init_scale, config.growth_factor, config.backoff_factor)
    if (
        not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)
        or not isinstance(config.growth_interval, int)
        or isinstance(config.growth_interval, bool)
    ):
        raise AotError(f"{source}: grad_scaler values must be numbers (growth_interval an integer), got {value!r}")
    if config.init_scale <= 0 or config.growth_factor <= 1 or not 0 < config.backoff_factor < 1 or config.growth_interval < 1:
        raise AotError(
            f"{source}: grad_scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
            f"growth_interval >= 1 (as torch.amp.GradScaler), got {value!r}"
        )
    return GradScalerConfig(float(config.init_scale), float(config.growth_factor), float(config.backoff_factor), config.growth_interval)


def resolve_precision(precision: str | None, reduce_dtype: str | None, model_globals: dict, model_name: str, profile: dict) -> Precision:
    """The build's precision: the CLI's choice, else the model file's `precision` /
    `reduce_dtype` / `grad_scaler`, else fp32; checked against the target's autocast."""
    source = "--precision" if precision is not None else f"{model_name}: precision"
    compute = _choice(precision if precision is not None else model_globals.get("precision", "fp32"), tuple(DTYPES), source)
    reduce_source = "--reduce-dtype" if reduce_dtype is not None else f"{model_name}: reduce_dtype"
    reduce = _choice(
        reduce_dtype if reduce_dtype is not None else model_globals.get("reduce_dtype", "fp32"),
        ("fp32", compute) if compute != "fp32" else ("fp32",),
        reduce_source,
    )
    device = profile.get("device_kind", "cpu")
    if compute == "fp32":
        if model_globals.get("grad_scaler") is not None:
            warnings.warn(f"{model_name}: grad_scaler applies to fp16 builds only; ignored", stacklevel=2)
        return Precision(rules=device)  # no autocast; the target still decides how SDPA is recorded (step.py)
    if compute not in AUTOCAST_DTYPES.get(device, ()):
        raise AotError(
            f"{source} {compute}: autocast on {device} (the target {profile.get('name')!r}) does not "
            f"support it; use {' or '.join(AUTOCAST_DTYPES.get(device, ())) or 'fp32'}"
        )
    if compute == "bf16" and device == "cuda":
        gpus = (profile.get("node") or {}).get("gpus") or {}
        old = sorted({g.get("name", "?") for g in gpus.values() if g.get("compute_capability") and tuple(g["compute_capability"]) < BF16_MIN_CAPABILITY})
        if old:
            raise AotError(
                f"{source} bf16: {', '.join(old)} in {profile.get('name')!r} cannot compute in bf16 "
                f"(compute capability below {'.'.join(map(str, BF16_MIN_CAPABILITY))}); use fp16"
            )
    scaler = _grad_scaler(model_globals.get("grad_scaler"), model_name) if compute == "fp16" else None
    return Precision(compute=compute, rules=device, reduce=reduce, scaler=scaler)


def check_training_state(precision: Precision, params: dict[str, torch.Tensor], model_name: str) -> None:
    """What mixed precision cannot take, refused in one line: parameters that are not fp32
    (autocast keeps fp32 master weights, and the optimizer updates them; GradScaler refuses to
    unscale fp16 gradients)."""
    if not precision.mixed:
        return
    low = [str(p.dtype).removeprefix("torch.") for p in params.values() if p.is_floating_point() and p.dtype != torch.float32]
    if low:
        raise AotError(
            f"{model_name}: --precision {precision.compute} keeps fp32 master weights, but model() makes "
            f"{len(low)} parameter(s) in {', '.join(sorted(set(low)))}; build the model in fp32 (no .half()/.to(dtype)) and "
            f"let autocast compute in {precision.compute}"
        )
