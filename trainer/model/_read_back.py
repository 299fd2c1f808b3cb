"""Reading an update's numbers back from the device once a step, not once a micro-batch: each read-back
(``float(t)``, ``.tolist()``) makes the host wait for every kernel queued before it, and the GPU then
idles while the host prepares the next ones."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog
import torch

if TYPE_CHECKING:
    from trainer.config import OptimConfig

log = structlog.get_logger("agentloop.trainer")


def clip_and_read_back(
    params: Iterable[torch.Tensor], max_norm: float, totals: dict[str, torch.Tensor]
) -> tuple[dict[str, float], float]:
    """Clip the gradients of ``params`` to ``max_norm``; returns ``totals`` (device scalars) as floats and
    the gradient norm before clipping, read back together in one CPU-GPU sync."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2's DTensor: the global norm, replicated on every rank
        norm = norm.full_tensor()
    device = next(iter(totals.values())).device if totals else norm.device
    scalars = [v.detach().double() for v in totals.values()]  # float64: counts stay exact
    values = torch.stack([*scalars, norm.to(device, torch.float64)]).tolist()
    grad_norm = values.pop()
    return dict(zip(totals, values, strict=True)), grad_norm


def clipped_step(
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    *,
    max_norm: float,
    optim: OptimConfig,
    step: int,
    totals: dict[str, torch.Tensor],
    role: str,
) -> tuple[dict[str, float], float]:
    """Clip, read back (:func:`clip_and_read_back`) and step ``optimizer`` with its learning rate warmed
    up linearly to ``optim.lr`` over ``optim.lr_warmup_steps`` (``step`` counts the updates done before
    this one); a step whose gradient norm is not finite is skipped and logged under ``role``. The
    gradients are zeroed either way."""
    read, grad_norm = clip_and_read_back(params, max_norm, totals)
    if math.isfinite(grad_norm):
        warmup = min(1.0, (step + 1) / optim.lr_warmup_steps) if optim.lr_warmup_steps > 0 else 1.0
        for group in optimizer.param_groups:  # every step: a run continued with a new lr takes it at once
            group["lr"] = optim.lr * warmup
        optimizer.step()
    else:
        log.warning(f"{role}.skip_step_nonfinite_grad", grad_norm=grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return read, grad_norm
