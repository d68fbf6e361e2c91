"""One optimizer step's pieces after the forward/backward: clipping + update, and its metrics.

Gradient clipping is done here, not by Megatron (its clip asserts CUDA tensors): the global
norm comes from the optimizer's ``get_grad_norm`` (which counts TP-duplicated and shared
parameters once and reduces over the right group), and gradients are scaled in place only
when the norm exceeds ``clip_grad``. A step whose gradient norm is not finite is skipped.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verl.utils.logging import warn_once

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = ["optimizer_params", "optimizer_step", "reduce_step_metrics"]


def optimizer_params(optimizer) -> list[torch.nn.Parameter]:
    """The parameters a (possibly chained) Megatron optimizer updates, as it sees them."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for opt in optimizers for p in opt.get_parameters()]


@torch.no_grad()
def optimizer_step(optimizer, clip_grad: float) -> tuple[float, bool]:
    """Clip by the global norm and step; returns (norm before clipping, whether the step was taken).

    ``clip_grad`` <= 0 turns clipping off.
    """
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        warn_once(logger, "non-finite gradient norm (%s): optimizer step skipped", grad_norm)
        optimizer.zero_grad()
        return grad_norm, False
    if clip_grad > 0:
        coeff = clip_grad / (grad_norm + 1e-6)
        if coeff < 1.0:
            for p in optimizer_params(optimizer):
                if p.grad is not None:
                    p.grad.mul_(coeff)
    ok = bool(optimizer.step_with_ready_grads())
    return grad_norm, ok


def reduce_step_metrics(
    losses: list[torch.Tensor],
    per_micro: list[dict[str, torch.Tensor]],
    pg: "ProcessGroupCollection",
    device: torch.device,
) -> tuple[float, dict[str, float]]:
    """(step loss, metrics) on every rank of the role from the last stage's micro-batch records.

    The loss is the sum of the loss shares over micro-batches and DP ranks divided by the DP size
    (each share carries a DP-size factor); every other metric is averaged over micro-batches
    and DP ranks, except those named ``max:...``, which are their maximum. Raises ValueError when
    a metric is missing from some micro-batches.
    """
    pp_size = pg.pp.size()
    last_stage = pg.pp.rank() == pp_size - 1
    src = dist.get_global_rank(pg.pp, pp_size - 1) if pp_size > 1 else None
    keys: list[str] = sorted(per_micro[0]) if last_stage else []
    if pp_size > 1:
        holder = [keys]
        dist.broadcast_object_list(holder, src=src, group=pg.pp, device=device if device.type == "cuda" else None)
        keys = holder[0]
    mean_keys = [k for k in keys if not k.startswith("max:")]
    max_keys = [k for k in keys if k.startswith("max:")]
    values = torch.zeros(1 + len(mean_keys), dtype=torch.float64, device=device)
    maxima = torch.full((max(len(max_keys), 1),), -math.inf, dtype=torch.float64, device=device)
    if last_stage:
        for k in keys:
            missing = [j for j, m in enumerate(per_micro) if k not in m]
            if missing:
                raise ValueError(f"loss_fn returned metric {k!r} for some micro-batches but not for {missing}")

        def stacked(items: list[torch.Tensor]) -> torch.Tensor:  # [micro-batches], float64, on device
            return torch.stack(
                [torch.as_tensor(x).to(device=device, dtype=torch.float64).reshape(()) for x in items]
            )

        # Reduced on the device and read back once below (values.tolist()), not one host sync per
        # micro-batch and metric.
        values[0] = stacked(losses).sum()
        for i, k in enumerate(mean_keys):
            values[1 + i] = stacked([m[k] for m in per_micro]).mean()
        for i, k in enumerate(max_keys):
            maxima[i] = stacked([m[k] for m in per_micro]).max()
    dp = pg.dp.size()
    if dp > 1:
        dist.all_reduce(values, group=pg.dp)
        values /= dp  # the loss shares carry a dp_size factor; the metric means are averaged
        if max_keys:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=pg.dp)
    if pp_size > 1:
        dist.broadcast(values, src=src, group=pg.pp)
        if max_keys:
            dist.broadcast(maxima, src=src, group=pg.pp)
    out = values.tolist()
    metrics = dict(zip(mean_keys, out[1:], strict=True))
    metrics.update(zip(max_keys, maxima.tolist()[: len(max_keys)], strict=True))
    return out[0], metrics
