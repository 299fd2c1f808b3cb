"""TorchEngine's decode step on a CPU for Llama-family models, written out instead of transformers' forward.

Why hand-written: on a CPU a decode step at batch 32 is bound by fp32 GEMMs of 32 rows against
every weight matrix (SmolLM2-135M: ~75 ms of a ~140 ms step through transformers). transformers
runs seven projections per layer, each a plain sgemm. Here q/k/v and gate/up are fused into one
projection each, and every projection uses MKL's packed GEMM (``cblas_sgemm_pack`` +
``cblas_sgemm_compute``, exposed as ``torch.ops.mkl._mkl_linear``; inductor's freezing pass uses
the same kernels): on the 2-core dev machine the step's GEMMs drop from ~82 ms to ~56 ms with the
same fp32 arithmetic. The rest of the step loses transformers' per-layer Python (mask
construction, cache objects, kwargs plumbing): one additive mask per step, keys and values
written with one ``index_copy_`` per layer, SDPA over the KV heads without copies.

Only the decode step is replaced; prefill stays on transformers' forward and both write the same
:class:`SlotKVCache`. Supported: ``model_type`` llama / mistral / qwen2 without sliding windows
(:func:`supports`); anything else keeps transformers' forward. After weights change in place,
:meth:`CpuDecoder.refresh` rebuilds the fused, packed copies. Those copies cost memory: about 2.4x
the weights' size (SmolLM2-135M fp32: +1.27 GB RSS on top of 0.77 GB); ``TorchEngine(cpu_decoder=False)``
keeps transformers' forward and no copies.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch
import torch.nn.functional as F

from agentloop.engine.torch._kv import SlotKVCache

log = structlog.get_logger(__name__)

SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2"})


def supports(model: Any) -> bool:
    """Whether :class:`CpuDecoder` reproduces ``model``'s forward (else keep transformers')."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", True) and getattr(cfg, "sliding_window", None):
        return False  # qwen2 keeps a window size it does not use (use_sliding_window=False)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return False
    attn, mlp = layers[0].self_attn, layers[0].mlp
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")) and all(
        hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")
    )


class PackedLinear:
    """``y = x @ cat(W_i).T + cat(b_i)`` for a group of ``nn.Linear`` sharing their input.

    The fused weight is packed by MKL for ``rows`` input rows. Inputs of at least ``rows / 2``
    rows are zero-padded to ``rows`` (the packed GEMM of ``rows`` rows costs about what a plain one
    of half as many does); smaller or larger inputs, and builds without MKL, use ``F.linear``.
    """

    def __init__(self, linears: list[Any], rows: int) -> None:
        self._linears = linears
        self.rows = rows
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused (and packed) weight from the modules' current parameters."""
        with torch.no_grad():
            ws = [lin.weight.detach() for lin in self._linears]
            self.weight = ws[0].contiguous() if len(ws) == 1 else torch.cat(ws).contiguous()
            if any(lin.bias is not None for lin in self._linears):
                self.bias = torch.cat(
                    [
                        lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                        for lin in self._linears
                    ]
                )
            self._packed = None
            if self.weight.dtype == torch.float32 and torch.backends.mkl.is_available():
                try:  # a private op (inductor's): a torch without it keeps the plain fused GEMM
                    self._packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, self.rows)
                except (AttributeError, RuntimeError) as exc:
                    log.warning("engine.mkl_pack_unavailable", error=f"{type(exc).__name__}: {exc}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self._packed is None or not (self.rows // 2 <= n <= self.rows):
            return F.linear(x, self.weight, self.bias)
        if n < self.rows:
            x = torch.cat([x, x.new_zeros(self.rows - n, x.shape[1])])
        y = torch.ops.mkl._mkl_linear(x, self._packed, self.weight, self.bias, self.rows)
        return y[:n] if n < self.rows else y


class _Layer:
    """One decoder layer's fused projections and the modules it still calls (norms, activation)."""

    def __init__(self, layer: Any, rows: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = (
            _RMSNorm(layer.input_layernorm),
            _RMSNorm(layer.post_attention_layernorm),
        )
        self.qkv = PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], rows)
        self.o = PackedLinear([attn.o_proj], rows)
        self.gate_up = PackedLinear([mlp.gate_proj, mlp.up_proj], rows)
        self.down = PackedLinear([mlp.down_proj], rows)
        self.act = mlp.act_fn
        self.scaling = float(attn.scaling)
        self.intermediate = mlp.gate_proj.out_features

    def projections(self) -> list[PackedLinear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class CpuDecoder:
    """The decode forward of a supported model over ``cache`` (see the module docstring)."""

    def __init__(self, model: Any, cache: SlotKVCache, rows: int) -> None:
        if not supports(model):
            raise ValueError(f"CpuDecoder does not support model_type {model.config.model_type!r}")
        cfg = model.config
        self._cache = cache
        inner = model.model
        self._embed, self._norm, self._rotary = inner.embed_tokens, _RMSNorm(inner.norm), inner.rotary_emb
        self._layers = [_Layer(layer, rows) for layer in inner.layers]
        self._head = PackedLinear([model.lm_head], rows)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)

    def refresh(self) -> None:
        """Re-fuse and re-pack every projection after the model's weights changed in place."""
        for layer in self._layers:
            for proj in layer.projections():
                proj.refresh()
        self._head.refresh()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Next-token logits ``(b, V)`` fp32 for rows ``0..b-1`` (slot ``i`` = row ``i``) holding
        token ``ids[i]`` at ``positions[i]``; writes their keys and values into the cache and
        attends over each slot's first ``kv_len`` positions (masked beyond its own position)."""
        b = ids.shape[0]
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        cache = self._cache
        x = self._embed(ids)  # (b, H)
        cos, sin = self._rotary(x, positions[:, None])  # (b, 1, d) each
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        # flat row of (slot i, kv head j, position p) in a layer's (slots * n_kv * capacity, d) view
        cap = cache.capacity
        slots = torch.arange(b, device=ids.device)[:, None] * (kv * cap)
        flat = (slots + torch.arange(kv, device=ids.device)[None, :] * cap + positions[:, None]).reshape(-1)
        visible = torch.arange(kv_len, device=ids.device)[None, :] <= positions[:, None]
        mask = torch.zeros(b, 1, 1, kv_len, dtype=x.dtype, device=x.device)
        mask.masked_fill_(~visible[:, None, None, :], float("-inf"))
        for i, layer in enumerate(self._layers):
            qkv = layer.qkv(layer.input_norm(x))
            qk = _rope(qkv[:, : (h + kv) * d].view(b, h + kv, d), cos, sin)  # q and k heads at once
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + kv) * d :].reshape(b * kv, d)
            k_layer, v_layer = cache.k[i], cache.v[i]  # (slots, n_kv, capacity, d), contiguous
            k_layer.view(-1, d).index_copy_(0, flat, k.reshape(b * kv, d))
            v_layer.view(-1, d).index_copy_(0, flat, v)
            att = F.scaled_dot_product_attention(
                q.view(b, kv, h // kv, d),  # query head j*g + r uses KV head j, as repeat_kv orders them
                k_layer[:b, :, :kv_len],
                v_layer[:b, :, :kv_len],
                attn_mask=mask,
                scale=layer.scaling,
            )  # (b, n_kv, g, d)
            x = x + layer.o(att.reshape(b, h * d))
            gate_up = layer.gate_up(layer.post_norm(x))
            n = layer.intermediate
            x = x + layer.down(layer.act(gate_up[:, :n]) * gate_up[:, n:])
        return self._head(self._norm(x)).float()


class _RMSNorm:
    """A Llama/Qwen2 ``RMSNorm`` module's arithmetic as one fused ``F.rms_norm`` (fp32 here, where
    the module's upcast is a no-op; other dtypes call the module)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.module(x)
        weight = self.module.weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``t`` (b, heads, d) with ``cos``/``sin`` (b, 1, d), as transformers'
    ``apply_rotary_pos_emb`` (rotate-half convention)."""
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos + rotated * sin
