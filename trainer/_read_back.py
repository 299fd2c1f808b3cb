"""Reading an update's numbers back from the device once a step, not once a micro-batch: each read-back
(``float(t)``, ``.tolist()``) makes the host wait for every kernel queued before it, and the GPU then
idles while the host prepares the next ones."""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
