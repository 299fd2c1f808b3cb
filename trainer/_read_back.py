"""Reading an update's numbers back from the device once a step, not once a micro-batch: each read-back
(``float(t)``, ``.tolist()``) makes the host wait for every kernel queued before it, and the GPU then
idles while the host prepares the next ones."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def clip_and_read_back(
    params: Iterable[torch.Tensor], max_norm: float, totals: dict[str, torch.Tensor]
) -> tuple[dict[str, float], float]:
    """Clip the gradients of ``params`` to ``max_norm``; returns ``totals`` (device scalars) as floats and
    the gradient norm before clipping, read back together in one CPU-GPU sync."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    if isinstance(norm, DTensor):  # FSDP2: the global norm, replicated on every rank
        norm = norm.full_tensor()
    values = torch.stack([*(v.detach().float() for v in totals.values()), norm.float()]).tolist()
    grad_norm = values.pop()
    return dict(zip(totals, values, strict=True)), grad_norm
