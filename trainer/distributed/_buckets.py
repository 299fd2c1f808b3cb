"""Flat weight buckets (trainer/distributed/weight_sync.py): a fixed layout of named tensors in a few big buckets of
one dtype each, 256-byte aligned offsets, and packing into / unpacking out of them. Pure and
CPU-testable: no process group, no GPU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
ALIGN_BYTES = 256


@dataclass(frozen=True)
class Entry:
    """One tensor inside a bucket: elements ``[offset, offset + numel)``, viewed as ``shape``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One flat tensor of ``numel`` elements of ``dtype`` holding ``entries``."""

    dtype: torch.dtype
    numel: int
    entries: tuple[Entry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Layout:
    """Where every sent tensor lives in which bucket; the same on trainer and replicas."""

    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [e.name for b in self.buckets for e in b.entries]


def plan_layout(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Layout:
    """Buckets for ``specs`` (name -> (shape, dtype)), in order, one dtype per bucket, each at most
    ``bucket_bytes`` unless a single tensor is larger (it then gets a bucket of its own)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN_BYTES:
        raise ValueError(f"bucket_bytes must be an int >= {ALIGN_BYTES}, got {bucket_bytes!r}")
    if not specs:
        raise ValueError("plan_layout needs at least one tensor spec (name -> (shape, dtype))")
    open_: dict[torch.dtype, list[Entry]] = {}
    fill: dict[torch.dtype, int] = {}
    done: list[Bucket] = []
    for name, (shape, dtype) in specs.items():
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"spec {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        size = torch.empty(0, dtype=dtype).element_size()
        align = max(1, ALIGN_BYTES // size)
        numel = 1
        for d in shape:
            numel *= int(d)
        start = -(-fill.get(dtype, 0) // align) * align
        if open_.get(dtype) and (start + numel) * size > bucket_bytes:  # full: close it, start anew
            done.append(Bucket(dtype, fill[dtype], tuple(open_.pop(dtype))))
            start = 0
        open_.setdefault(dtype, []).append(Entry(name, tuple(int(d) for d in shape), start, numel))
        fill[dtype] = start + numel
    done += [Bucket(dtype, fill[dtype], tuple(entries)) for dtype, entries in open_.items()]
    return Layout(tuple(done))


def alloc_buckets(layout: Layout, device: torch.device | str) -> list[torch.Tensor]:
    """Empty flat buckets for ``layout`` on ``device``."""
    return [torch.empty(b.numel, dtype=b.dtype, device=device) for b in layout.buckets]


@torch.no_grad()
def pack_one(
    buckets: list[torch.Tensor], index: dict[str, tuple[int, Entry]], name: str, t: torch.Tensor
) -> None:
    """Copy ``t`` (cast to the bucket's dtype) into its place; ``index`` from ``entry_index``."""
    b, e = index[name]
    if t.numel() != e.numel:
        raise ValueError(
            f"{name!r}: expected {e.numel} elements (shape {e.shape}), got shape {tuple(t.shape)}"
        )
    buckets[b][e.offset : e.offset + e.numel].copy_(t.detach().reshape(-1), non_blocking=True)


def entry_index(layout: Layout) -> dict[str, tuple[int, Entry]]:
    """name -> (bucket index, entry)."""
    return {e.name: (i, e) for i, b in enumerate(layout.buckets) for e in b.entries}


def pack(
    named: Mapping[str, torch.Tensor], layout: Layout, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """New buckets on ``device`` holding every tensor of ``layout`` from ``named``."""
    missing = [n for n in layout.names if n not in named]
    if missing:
        raise ValueError(f"pack: {len(missing)} tensor(s) of the layout are missing, e.g. {missing[:3]}")
    buckets, index = alloc_buckets(layout, device), entry_index(layout)
    for name in layout.names:
        pack_one(buckets, index, name, named[name])
    return buckets


def unpack(buckets: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Views (no copy) of every tensor of ``layout`` into ``buckets``."""
    if len(buckets) != len(layout.buckets):
        raise ValueError(f"unpack: the layout has {len(layout.buckets)} buckets, got {len(buckets)}")
    out: dict[str, torch.Tensor] = {}
    for t, b in zip(buckets, layout.buckets, strict=True):
        if t.dtype != b.dtype or t.numel() != b.numel:
            raise ValueError(f"unpack: expected a bucket of {b.numel} {b.dtype}, got {t.numel()} {t.dtype}")
        for e in b.entries:
            out[e.name] = t[e.offset : e.offset + e.numel].view(e.shape)
    return out
