"""The slot KV cache of TorchEngine and its prefix cache of finished requests.

``SlotKVCache`` quacks like a transformers ``Cache``: attention layers call ``update(k, v,
layer_idx)`` and get back the keys/values to attend over. The engine sets, before each forward,
which rows it writes (a group of consecutive slots for a batched prefill, slots 0..B-1 for a
decode step) and at which positions (device tensors, written in place: a decode step allocates
no cache memory), and passes the matching 4D boolean mask itself.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

_MIN_CAPACITY = 256


class SlotKVCache:
    """``K, V: (n_layers, max_batch, n_kv_heads, capacity, head_dim)``; capacity grows by doubling.

    One tensor per K and V (per-layer views ``k[i]``, ``v[i]``), so moving, reading or writing a
    slot is one copy for all layers. ``generation`` changes whenever the storage is reallocated
    (captured CUDA graphs hold its addresses and must be dropped then).
    """

    def __init__(
        self, n_layers: int, max_batch: int, n_kv: int, head_dim: int, max_context: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.n_layers, self.max_batch, self.n_kv, self.head_dim = n_layers, max_batch, n_kv, head_dim
        self.max_context, self.dtype, self.device = max_context, dtype, device
        self.capacity = 0
        self.generation = 0
        self.K = torch.zeros(0, device=device, dtype=dtype)
        self.V = torch.zeros(0, device=device, dtype=dtype)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._mode = "decode"
        self._start = 0  # prefill: first slot of the group
        self._n = 0  # decode: rows 0..n-1
        self._pos = torch.zeros(0, dtype=torch.long, device=device)
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
        shape = (self.n_layers, self.max_batch, self.n_kv, new, self.head_dim)
        # zeros, not empty: masked positions still enter P @ V, and 0 * NaN would poison a row
        K = torch.zeros(shape, dtype=self.dtype, device=self.device)
        V = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            K[:, :, :, : self.capacity].copy_(self.K)
            V[:, :, :, : self.capacity].copy_(self.V)
        self.K, self.V = K, V
        self.k, self.v = list(K.unbind(0)), list(V.unbind(0))
        self.capacity = new
        self.generation += 1

    def set_prefill(self, first_slot: int, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward writes slots ``first_slot..first_slot+m-1`` at ``positions`` (m, q) and
        attends over their first ``kv_len`` positions (the caller passes the 4D mask)."""
        self._mode, self._start, self._pos, self._att = "prefill", first_slot, positions, kv_len

    def set_decode(self, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward writes position ``positions[i]`` of slot ``i`` for each row (slots 0..B-1)
        and attends over their first ``kv_len`` positions. ``positions`` is kept, not copied (a
        static buffer under CUDA graphs)."""
        self._mode, self._pos, self._att, self._n = "decode", positions, kv_len, positions.shape[0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer_idx], self.v[layer_idx]
        # scatter_ along the position dim (100x faster than advanced-index assignment on CPU)
        a, b = (self._start, self._start + self._pos.shape[0]) if self._mode == "prefill" else (0, self._n)
        index = self._index(key_states.shape)
        k[a:b].scatter_(2, index, key_states)  # key_states (rows, n_kv, q, head_dim)
        v[a:b].scatter_(2, index, value_states)
        return k[a:b, :, : self._att], v[a:b, :, : self._att]

    def _index(self, shape: torch.Size) -> torch.Tensor:
        pos = self._pos if self._pos.dim() == 2 else self._pos[:, None]  # (rows, q)
        return pos[:, None, :, None].expand(shape)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._att

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst`` (all layers, one copy each)."""
        self.K[:, dst, :, :length] = self.K[:, src, :, :length]
        self.V[:, dst, :, :length] = self.V[:, src, :, :length]

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's keys and values: ``(n_layers, n_kv, length, head_dim)`` each."""
        return self.K[:, slot, :, :length].clone(), self.V[:, slot, :, :length].clone()

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        self.ensure_capacity(length)
        self.K[:, slot, :, :length] = k[:, :, :length]
        self.V[:, slot, :, :length] = v[:, :, :length]


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
