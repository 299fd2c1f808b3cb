"""The slot KV cache of TorchEngine and its prefix cache of finished requests.

``SlotKVCache`` quacks like a transformers ``Cache``: attention layers call ``update(k, v,
layer_idx)`` and get back the keys/values to attend over. The engine sets, before each forward,
which rows it writes (a group of consecutive slots for a batched prefill, slots 0..B-1 for a
decode step) and at which positions (device tensors, written in place: a decode step allocates
no cache memory), and passes the matching 4D boolean mask itself.

Memory follows use, not the limits: the cache holds ``rows x capacity`` positions, rows a power of
two at least the running requests (at most ``max_batch``), capacity grown by doubling as the longest
running request needs it. One position costs ``bytes_per_token = 2 (K, V) x n_layers x n_kv_heads x
head_dim x dtype size`` (SmolLM2-135M fp32: 46 KB, so its full 8192-token context is 377 MB per
sequence and 12 GB for 32 of them; the engine bounds the whole with a budget, engine.py).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

_MIN_CAPACITY = 256


def kv_shape(config: Any) -> tuple[int, int, int]:
    """``(n_layers, n_kv_heads, head_dim)`` of a transformers config."""
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    return int(config.num_hidden_layers), int(n_kv), int(head_dim)


# The default KV budget: this share of the memory free when the engine is built (CPU: MemAvailable;
# CUDA: the device's free memory, the weights already on it). Half: the rest stays for activations,
# the prefix cache's copies in flight, a colocated trainer, and whatever else runs on the machine.
DEFAULT_KV_SHARE = 0.5


def default_kv_budget(device: torch.device) -> int:
    """``DEFAULT_KV_SHARE`` of the memory free on ``device`` now, in bytes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(DEFAULT_KV_SHARE * free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(DEFAULT_KV_SHARE * int(line.split()[1]) * 1024)
    except OSError:
        pass
    import os

    try:  # not Linux: a quarter of the physical memory
        return int(0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def capacity_for(n: int, max_context: int) -> int:
    """The positions the cache allocates for a request that may reach ``n``: the next power of two
    (at least ``_MIN_CAPACITY``), at most ``max_context``."""
    cap = _MIN_CAPACITY
    while cap < n:
        cap *= 2
    return min(cap, max_context)


def rows_for(n: int, max_batch: int) -> int:
    """The rows the cache allocates for ``n`` running requests: the next power of two (the decode
    step's batch bucket, whose padding rows write into the slots past ``n``), at most ``max_batch``."""
    rows = 1
    while rows < n:
        rows *= 2
    return min(rows, max_batch)


class SlotKVCache:
    """``K, V: (n_layers, rows, n_kv_heads, capacity, head_dim)``; rows and capacity grow on demand.

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
        self.bytes_per_token = 2 * n_layers * n_kv * head_dim * torch.empty(0, dtype=dtype).element_size()
        self.capacity = 0
        self.rows = 0
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
        self.reset()

    @classmethod
    def for_model(
        cls, model: Any, max_batch: int, max_context: int, dtype: torch.dtype, device: torch.device
    ) -> SlotKVCache:
        n_layers, n_kv, head_dim = kv_shape(model.config)
        return cls(n_layers, max_batch, n_kv, head_dim, max_context, dtype, device)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds now (K and V)."""
        return self.rows * self.capacity * self.bytes_per_token

    def reset(self) -> None:
        """Back to the smallest cache (one row of ``_MIN_CAPACITY`` positions); the data is dropped."""
        self._resize(1, min(_MIN_CAPACITY, self.max_context), keep_rows=0, keep_positions=0)

    def ensure_rows(self, n: int) -> None:
        """Room for slots ``0..n-1`` and the decode step's padding rows (``rows_for(n)``)."""
        if n > self.rows:
            self._resize(rows_for(n, self.max_batch), self.capacity)

    def ensure_capacity(self, needed: int, limit: int | None = None) -> None:
        """Grow (copying) so ``needed`` positions fit; amortised O(1) per token: doubling, but never
        past ``limit`` (the most positions a running request may reach) nor ``max_context``."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity, _MIN_CAPACITY)
        self._resize(self.rows, min(cap, max(limit or cap, needed), self.max_context))

    def fit(self, n_rows: int, needed: int, limit: int) -> None:
        """Room for ``n_rows`` running requests and ``needed`` positions. When either grows, the new
        storage is ``rows_for(n_rows)`` rows (dropping rows past them: free slots) and a capacity
        doubled to a power of two (few reallocations, few CUDA-graph kv buckets) but at most ``limit``
        (``capacity_for`` of the longest a running request may reach): a capacity left from a longer
        request that has finished is dropped then."""
        if n_rows <= self.rows and needed <= self.capacity:
            return
        cap = (
            self.capacity
            if needed <= self.capacity
            else max(2 * self.capacity, capacity_for(needed, self.max_context))
        )
        self._resize(rows_for(n_rows, self.max_batch), max(needed, min(cap, limit, self.max_context)))

    def _resize(
        self, rows: int, capacity: int, keep_rows: int | None = None, keep_positions: int | None = None
    ) -> None:
        shape = (self.n_layers, rows, self.n_kv, capacity, self.head_dim)
        # zeros, not empty: masked positions still enter P @ V, and 0 * NaN would poison a row
        K = torch.zeros(shape, dtype=self.dtype, device=self.device)
        V = torch.zeros(shape, dtype=self.dtype, device=self.device)
        r = min(rows, self.rows if keep_rows is None else keep_rows)
        p = min(capacity, self.capacity if keep_positions is None else keep_positions)
        if r and p:
            K[:, :r, :, :p].copy_(self.K[:, :r, :, :p])
            V[:, :r, :, :p].copy_(self.V[:, :r, :, :p])
        self.K, self.V = K, V
        self.k, self.v = list(K.unbind(0)), list(V.unbind(0))
        self.rows, self.capacity = rows, capacity
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
        self.ensure_rows(slot + 1)
        self.ensure_capacity(length)
        self.K[:, slot, :, :length] = k[:, :, :length]
        self.V[:, slot, :, :length] = v[:, :, :length]


class PrefixCache:
    """A small LRU of finished requests' KV, keyed by their token ids (prompt + response).

    An entry whose ids start another's is dropped when that one is stored (every prompt it could
    serve, the longer one serves at least as far): an agent's growing conversation keeps one entry,
    not one copy per call. ``tokens`` counts the positions held (each costs the cache's
    ``bytes_per_token``); ``store`` evicts the least recently used entries to stay within the room
    the engine gives it. Matching is vectorised (NumPy) so a 32k-token prompt against 16 entries
    costs well under a millisecond.
    """

    def __init__(self, max_entries: int = 16, min_match: int = 4) -> None:
        self.max_entries = max_entries
        self.min_match = min_match
        self.tokens = 0
        self._entries: collections.OrderedDict[
            tuple[int, ...], tuple[np.ndarray, torch.Tensor, torch.Tensor]
        ] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, ids: list[int], cache: SlotKVCache, slot: int, room_tokens: int | None = None) -> None:
        """Keep slot ``slot``'s KV of ``ids``, within ``room_tokens`` positions in all (None: no limit)."""
        if self.max_entries <= 0 or len(ids) < self.min_match:
            return
        if room_tokens is not None and len(ids) > room_tokens:
            return
        key = tuple(ids)
        arr = np.asarray(ids, dtype=np.int64)
        for old in [k for k, e in self._entries.items() if len(k) <= len(key) and _same_start(e[0], arr)]:
            self._drop(old)
        k, v = cache.read(slot, len(ids))
        self._entries[key] = (arr, k, v)
        self.tokens += len(ids)
        while len(self._entries) > self.max_entries or (
            room_tokens is not None and self.tokens > room_tokens
        ):
            self._drop(next(iter(self._entries)))

    def evict_to(self, room_tokens: int) -> None:
        """Drop the least recently used entries until at most ``room_tokens`` positions are held."""
        while self._entries and self.tokens > room_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)

    def match(self, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` :meth:`lookup` would serve (nothing is copied)."""
        best, _ = self._best(prompt, len(prompt) - 1)
        return best

    def _best(self, prompt: list[int], max_len: int) -> tuple[int, tuple[int, ...] | None]:
        if not self._entries:
            return 0, None
        query = np.asarray(prompt[:max_len], dtype=np.int64)
        best, best_key = 0, None
        for key, (ids, _, _) in self._entries.items():
            n = _common_prefix(ids, query)
            if n > best:
                best, best_key = n, key
        return (best, best_key) if best >= self.min_match else (0, None)

    def lookup(self, prompt: list[int], cache: SlotKVCache, slot: int, max_len: int) -> int:
        """Copy the longest cached prefix of ``prompt`` (at most ``max_len`` tokens) into ``slot``;
        returns its length (0 when nothing useful matched)."""
        best, best_key = self._best(prompt, max_len)
        if best_key is None:
            return 0
        self._entries.move_to_end(best_key)
        _, k, v = self._entries[best_key]
        cache.write(slot, k, v, best)
        return best

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _same_start(short: np.ndarray, long: np.ndarray) -> bool:
    return len(short) <= len(long) and bool(np.array_equal(short, long[: len(short)]))
