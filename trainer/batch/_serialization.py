"""How a batch crosses processes (Ray's object store, actor calls): its CPU tensors pickle as NumPy
arrays, which pickle protocol 5 hands over out of band, so Ray copies their bytes once into shared
memory instead of running torch's own tensor serialization. For scale_bench's 128-row batch (3.9 MB)
that takes ``ray.put`` plus the call reaching an actor from 21 to 8 ms on a 2-core AMD EPYC
(benchmarks/results/batch_transfer_cpu.json, the two taking turns; 1.8-2.7x over three runs).

Only pickle protocol 5 (Ray's) takes this path; copies and older protocols pickle a batch as any
object. Arrays that arrive read-only (Ray's zero-copy views of shared memory) are copied, so the tensors a
worker gets are its own to write. Tensors NumPy cannot hold (bfloat16, on a GPU, needing gradients,
sparse, subclasses) pickle as torch pickles them.
"""

from __future__ import annotations

from typing import Any, SupportsIndex

import numpy as np
import torch

_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
    | {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64}
)
OUT_OF_BAND_PROTOCOL = 5  # pickle's first protocol with out-of-band buffers; Ray pickles with it


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
        numpy_can = (
            type(value) is torch.Tensor  # not a subclass, which would come back a plain tensor
            and value.device.type == "cpu"
            and value.layout == torch.strided
            and value.dtype in _NUMPY_DTYPES
            and not (value.requires_grad or value.is_neg() or value.is_conj())
        )
        return _AsArray(value) if numpy_can else value
    if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: _portable(v) for k, v in value.items()}
    return value


def _rebuild(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**fields)


def reduce_fields(obj: Any, protocol: SupportsIndex) -> str | tuple[Any, ...]:
    """``__reduce_ex__`` for a dataclass of tensors: at protocol 5 its fields, CPU tensors (and dicts
    of them) as arrays; below it as any object (``copy.copy`` and ``copy.deepcopy`` use protocol 4
    and keep their meaning: the same tensors, shared tensors still shared; ``torch.save`` uses 2)."""
    if protocol.__index__() < OUT_OF_BAND_PROTOCOL:
        return object.__reduce_ex__(obj, protocol)
    return _rebuild, (type(obj), {name: _portable(value) for name, value in vars(obj).items()})
