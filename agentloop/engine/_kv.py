"""The slot KV cache of TorchEngine and its prefix cache of finished requests.

``SlotKVCache`` quacks like a transformers ``Cache``: attention layers call ``update(k, v,
layer_idx)`` and get back the keys/values to attend over. The engine sets, before each forward,
which rows it writes (one slot for a prefill, slots 0..n-1 for a decode step) and at which
positions, and passes the matching 4D boolean mask itself.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

_MIN_CAPACITY = 256


class SlotKVCache:
    """Per layer ``k, v: (max_batch, n_kv_heads, capacity, head_dim)``; capacity grows by doubling."""

    def __init__(
        self, n_layers: int, max_batch: int, n_kv: int, head_dim: int, max_context: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.n_layers, self.max_batch, self.n_kv, self.head_dim = n_layers, max_batch, n_kv, head_dim
        self.max_context, self.dtype, self.device = max_context, dtype, device
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._mode = "decode"
        self._slot = 0
        self._start = 0
        self._q = 0
        self._pos = torch.zeros(0, dtype=torch.long)
        self._att = 0
        self.ensure_capacity(min(_MIN_CAPACITY, max_context))

    @classmethod
    def for_model(
        cls, model: Any, max_batch: int, max_context: int, dtype: torch.dtype, device: torch.device
    ) -> SlotKVCache:
        cfg = model.config
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        return cls(cfg.num_hidden_layers, max_batch, n_kv, head_dim, max_context, dtype, device)

    def ensure_capacity(self, needed: int) -> None:
        """Grow (copying) so ``needed`` positions fit; amortised O(1) per token."""
        if needed <= self.capacity:
            return
        new = min(max(needed, 2 * self.capacity, _MIN_CAPACITY), self.max_context)
        shape = (self.max_batch, self.n_kv, new, self.head_dim)
        for store in (self.k, self.v):
            for i in range(self.n_layers):
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    t[:, :, : self.capacity].copy_(store[i])
                    store[i] = t
                else:
                    store.append(t)
        self.capacity = new

    def set_prefill(self, slot: int, start: int, q_len: int) -> torch.Tensor:
        """Next forward writes ``q_len`` positions from ``start`` into ``slot``; returns its causal
        mask ``(1, 1, q_len, start + q_len)`` (True = attend)."""
        self._mode, self._slot, self._start, self._q = "prefill", slot, start, q_len
        kv = torch.arange(start + q_len, device=self.device)
        q = torch.arange(start, start + q_len, device=self.device)
        return (kv[None, :] <= q[:, None])[None, None]

    def set_decode(self, positions: torch.Tensor) -> torch.Tensor:
        """Next forward writes one position per row of slots 0..n-1; returns the mask
        ``(n, 1, 1, max(pos) + 1)`` hiding each row's unused cache positions."""
        self._mode, self._pos = "decode", positions
        self._rows = torch.arange(len(positions), device=self.device)
        self._att = int(positions.max()) + 1
        kv = torch.arange(self._att, device=self.device)
        return (kv[None, :] <= positions[:, None])[:, None, None, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self._mode == "prefill":
            s, a, b = self._slot, self._start, self._start + self._q
            k[s, :, a:b] = key_states[0]
            v[s, :, a:b] = value_states[0]
            return k[s : s + 1, :, :b], v[s : s + 1, :, :b]
        n = len(self._pos)
        k[self._rows, :, self._pos] = key_states[:, :, 0]  # (n, n_kv, head_dim)
        v[self._rows, :, self._pos] = value_states[:, :, 0]
        return k[:n, :, : self._att], v[:n, :, : self._att]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._start + self._q if self._mode == "prefill" else self._att

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's keys and values: ``(n_layers, n_kv, length, head_dim)`` each."""
        return (
            torch.stack([t[slot, :, :length] for t in self.k]),
            torch.stack([t[slot, :, :length] for t in self.v]),
        )

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        self.ensure_capacity(length)
        for i in range(self.n_layers):
            self.k[i][slot, :, :length] = k[i, :, :length]
            self.v[i][slot, :, :length] = v[i, :, :length]


class PrefixCache:
    """A small LRU of finished requests' KV, keyed by their token ids (prompt + response)."""

    def __init__(self, max_entries: int = 16, min_match: int = 4) -> None:
        self.max_entries = max_entries
        self.min_match = min_match
        self._entries: collections.OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = (
            collections.OrderedDict()
        )

    def store(self, ids: list[int], cache: SlotKVCache, slot: int) -> None:
        if self.max_entries <= 0 or len(ids) < self.min_match:
            return
        key = tuple(ids)
        self._entries[key] = cache.read(slot, len(ids))
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, prompt: list[int], cache: SlotKVCache, slot: int, max_len: int) -> int:
        """Copy the longest cached prefix of ``prompt`` (at most ``max_len`` tokens) into ``slot``;
        returns its length (0 when nothing useful matched)."""
        best, best_key = 0, None
        for key in self._entries:
            n = _common_prefix(key, prompt, max_len)
            if n > best:
                best, best_key = n, key
        if best < self.min_match or best_key is None:
            return 0
        self._entries.move_to_end(best_key)
        k, v = self._entries[best_key]
        cache.write(slot, k, v, best)
        return best

    def clear(self) -> None:
        self._entries.clear()


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == tuple(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == tuple(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo
