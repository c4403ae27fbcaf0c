"""fp16 dynamic loss scaling inside the step graph, with torch.amp.GradScaler's semantics.

Eager code does, each step:

    scaler.scale(loss).backward()      # loss * scale
    scaler.unscale_(optimizer)         # grads * (1 / scale), found_inf = any grad not finite
    clip_grad_norm_(...)
    scaler.step(optimizer)             # optimizer.step() unless found_inf
    scaler.update()                    # scale *= backoff on found_inf, *= growth after
                                       # growth_interval clean steps in a row

A static graph cannot leave out the optimizer's update, so it runs it and then puts back, where
found_inf is set, every tensor the update wrote (`where(found_inf, before, after)`): the same
values as not stepping, at the cost of one copy of parameters and optimizer state while the
update runs. The scale, the growth tracker and the count of skipped steps are training state
(program inputs updated in place; checkpointed like optimizer state); the runner reads the
count to hold the learning-rate schedule back on skipped steps, as loops that skip
scheduler.step() with the optimizer's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aot.capture.precision import GradScalerConfig


@dataclass
class LossScaling:
    config: GradScalerConfig
    scale: torch.Tensor
    growth_tracker: torch.Tensor
    skipped_steps: torch.Tensor

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """GradScaler.unscale_: (every gradient times 1/scale, the reciprocal taken in float64 as
        GradScaler does; found_inf, 1 element, 1.0 where any gradient is inf or NaN). The op's
        functional form: found_inf is then a value the graph's edges lead to, so no pass can
        move its all_reduce ahead of the check (the in-place form writes it without an edge)."""
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
        out: dict[int, torch.Tensor] = {}
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for members in by_dtype.values():  # one dtype per call, as GradScaler groups them
            unscaled, found_inf = torch.ops.aten._amp_foreach_non_finite_check_and_unscale.default([grads[i] for i in members], found_inf, inv_scale)
            out.update(zip(members, unscaled))
        return [out[i] for i in range(len(grads))], found_inf

    def step_unless(self, found_inf: torch.Tensor, written: list[torch.Tensor], step) -> None:
        """Run `step` (the optimizer's update of `written`), then keep the values from before it
        wherever found_inf is set."""
        before = [t.clone() for t in written]
        step()
        skip = found_inf.reshape(()) > 0
        with torch.no_grad():
            for t, old in zip(written, before):
                t.copy_(torch.where(skip, old, t))

    def update(self, found_inf: torch.Tensor) -> None:
        """GradScaler.update, and the count of skipped steps."""
        c = self.config
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, c.growth_factor, c.backoff_factor, c.growth_interval)
        self.skipped_steps.add_((found_inf > 0).to(self.skipped_steps.dtype))
