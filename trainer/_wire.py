"""How a batch crosses processes (Ray's object store, actor calls): its CPU tensors pickle as NumPy
arrays, which pickle protocol 5 hands over out of band, so Ray copies their bytes once into shared
memory instead of running torch's own tensor serialization. For scale_bench's 128-row batch (3.9 MB)
that takes ``ray.put`` plus the call reaching an actor from 16-29 to 9-13 ms on a 2-core AMD EPYC
(benchmarks/batch_transfer.py, 1.8-2.3x over two runs).

Arrays that arrive read-only (Ray's zero-copy views of shared memory) are copied, so the tensors a
worker gets are its own to write. Tensors NumPy cannot hold (bfloat16, on a GPU, needing gradients)
pickle as torch pickles them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64}
)


def _tensor_from_array(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class _AsArray:
    """A CPU tensor that pickles as its NumPy view and unpickles as a tensor again."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        return _tensor_from_array, (self.tensor.numpy(),)


def _portable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        numpy_can = value.device.type == "cpu" and value.dtype in _NUMPY_DTYPES and not value.requires_grad
        return _AsArray(value) if numpy_can else value
    if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: _portable(v) for k, v in value.items()}
    return value


def _rebuild(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**fields)


def reduce_fields(obj: Any) -> tuple[Any, tuple[type, dict[str, Any]]]:
    """``__reduce__`` for a dataclass of tensors: its fields, CPU tensors (and dicts of them) as arrays."""
    return _rebuild, (type(obj), {name: _portable(value) for name, value in vars(obj).items()})
