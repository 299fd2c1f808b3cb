"""The decoder's hidden states at the positions that score a micro-batch's response tokens.

Two shortcuts of the trainer's forward, each used only where a probe finds it exact for the model:
- the LM head on the response positions only (``response_hidden``): with a 49k-151k vocabulary the
  head is a fifth or more of the matmul work, and the prompt's logits are never used;
- each distinct prompt of a micro-batch run once (``shared_prompt_hidden``): a GRPO group's attempts
  share their prompt, which then runs once and serves every attempt through the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import structlog
import torch
from torch import nn

from agentloop.engine.models import cache_argument
from trainer.batch import Batch, index_on
from trainer.model.attention_mask import attention_mask_for
from trainer.model.head import head_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = structlog.get_logger("agentloop.trainer.hidden")

_PROBE_TOKENS = 16
_PROBE_VOCAB_CHUNK = 8192  # head probe: vocabulary rows per step, so its float32 temporaries stay small
# shared-prompt probe, relative to the largest hidden value: the cached forward sums attention in another
# order (fp32: ~1e-7 relative through the tiny models' layers; TF32 ~1e-3); a mask that lets a token see
# the wrong keys, or a cache that drops state, moves hidden states by their own size
_SHARED_PROMPT_REL_TOL = 1e-2


def response_hidden(
    model: nn.Module, mb: Batch, p: int, r: int, shared_prompts: bool = False
) -> tuple[torch.Tensor, nn.Linear] | None:
    """Final hidden states (b, R, d) at the positions that score the response tokens, and the LM head;
    None for models whose logits are more than ``hidden @ head.weight.T`` (soft-capping,
    logit scaling, a head with bias or wrapped by an adapter), which take the plain full forward.

    The head then runs on those R positions only (trainer/model/head.py), not on the prompt: with a
    49k-151k vocabulary it is a fifth or more of the model's matmul work.
    """
    hf = cast("PreTrainedModel", model)  # nn.Module would type these methods as Tensor
    head = hf.get_output_embeddings()
    decoder = hf.get_decoder() if hasattr(model, "get_decoder") else None
    cfg = model.config
    plain_head = type(head) is nn.Linear and head.bias is None
    if decoder is None or not plain_head or getattr(cfg, "final_logit_softcapping", None):
        return None
    if getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    if shared_prompts:
        shared = shared_prompt_hidden(
            decoder,
            mb.input_ids,
            mb.attention_mask,
            mb.position_ids,
            p,
            r,
            mb.rows_on_host().prompt_ids,
            mb.prompts_unpadded(),
        )
        if shared is not None:
            return shared, head
    hidden = decoder(  # use_cache=False: a KV cache in training only copies keys and values
        input_ids=mb.input_ids,
        attention_mask=attention_mask_for(decoder, mb.attention_mask, mb.fully_real()),
        position_ids=mb.position_ids,
        use_cache=False,
    ).last_hidden_state  # (b, P+R, d)
    return hidden[:, p - 1 : p + r - 1], head


class HeadJob:
    """What :func:`response_logprobs` computes: ``mb`` is the decoder's input (padding columns after the
    response allowed), ``responses`` (b, R) the tokens to score, ``temperatures`` (b, R, 1) what their
    logits are divided by. A plain object, not a dataclass: FSDP's pre-forward, which walks dataclasses
    and moves their tensors, passes it through the sharded model's head forward as it is
    (trainer/distributed/_sharding.py)."""

    __slots__ = ("compile", "compute_dtype", "mb", "responses", "shared_prompts", "temperatures")

    def __init__(
        self,
        mb: Batch,
        responses: torch.Tensor,
        temperatures: torch.Tensor,
        *,
        shared_prompts: bool,
        compute_dtype: torch.dtype,
        compile: bool,
    ) -> None:
        self.mb, self.responses, self.temperatures = mb, responses, temperatures
        self.shared_prompts, self.compute_dtype, self.compile = shared_prompts, compute_dtype, compile


def response_logprobs(model: nn.Module, job: HeadJob) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Log-probs and entropies (b, R) of ``job.responses`` under logits / ``job.temperatures``: the
    decoder's hidden states at the response positions (:func:`response_hidden`) and the LM head run
    chunked (trainer/model/head.py); None for models where that shortcut does not apply."""
    fused = response_hidden(model, job.mb, job.mb.prompt_length, job.responses.shape[1], job.shared_prompts)
    if fused is None:
        return None
    hidden, head = fused
    return head_logprobs(
        # (h / T) @ W.T = logits / T (the head has no bias); divided in fp32, so T is not rounded to
        # bf16 first where the hidden states are bf16 (autocast, bf16 parameters)
        hidden.float() / job.temperatures,
        head.weight,
        job.responses,
        compute_dtype=job.compute_dtype,
        compile=job.compile,
    )


def shared_prompt_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    p: int,
    r: int,
    prompt_ids: Sequence[int] | None = None,
    prompts_unpadded: bool = False,
) -> torch.Tensor | None:
    """The decoder's final hidden states (b, R, d) at the positions that score the response tokens
    (columns p-1 .. p+r-2 of the (b, P+R) rows), with each distinct prompt run once.

    The attempts of a GRPO group share their prompt, often most of the tokens (a system prompt, tool
    schemas, worked examples). Each distinct prompt goes through the decoder once with a KV cache; the
    cache is indexed out to its rows and the responses run on top of it. Gradients flow through the
    shared keys and values into the prompt's single forward, so the loss and its gradient are those of
    the full forward (``shared_prompt_is_exact`` checks the model once). None when no two rows share
    a prompt or the model returned no cache: the caller runs the plain forward.

    ``prompt_ids`` (rows with equal prompts share an id, ``HostRows.prompt_ids``) find the distinct
    prompts on the host; without them they are found on the device (``torch.unique``: a CPU-GPU sync).
    ``prompts_unpadded`` (no row's prompt is left-padded) lets the prompts' pass take SDPA's causal path.
    """
    if prompt_ids is not None:
        firsts: dict[int, int] = {}
        for row, prompt in enumerate(prompt_ids):
            firsts.setdefault(prompt, row)
        if len(firsts) == len(prompt_ids) or p == 0:
            return None
        slot = {prompt: k for k, prompt in enumerate(firsts)}
        first = index_on(input_ids.device, list(firsts.values()))  # (u,) a row holding each prompt
        inverse = index_on(input_ids.device, [slot[prompt] for prompt in prompt_ids])  # (b,)
    else:
        key = torch.cat([input_ids[:, :p], attention_mask[:, :p]], dim=1)  # (b, 2P): the same pads too
        distinct, inverse = torch.unique(key, dim=0, return_inverse=True)  # note: CPU-GPU sync
        if distinct.shape[0] == key.shape[0] or p == 0:
            return None
        rows = torch.arange(key.shape[0], device=key.device)
        first = torch.full((distinct.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
        first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # (u,) a row holding each prompt
    prompt = decoder(
        input_ids=input_ids[first, :p],
        attention_mask=attention_mask_for(decoder, attention_mask[first, :p], prompts_unpadded),
        position_ids=position_ids[first, :p],
        use_cache=True,
    )
    cache = getattr(prompt, "cache", None)  # transformers >= 5.x; earlier: past_key_values
    cache = getattr(prompt, "past_key_values", None) if cache is None else cache
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    last = prompt.last_hidden_state[inverse, p - 1 : p]  # (b, 1, d) scores the first response token
    if r <= 1:
        return last
    cache.batch_select_indices(inverse)  # (u, ...) -> (b, ...) keys and values, differentiable
    rest = decoder(  # the last response token scores nothing: it is not run
        input_ids=input_ids[:, p : p + r - 1],
        attention_mask=attention_mask[:, : p + r - 1],
        position_ids=position_ids[:, p : p + r - 1],
        use_cache=True,
        **{cache_argument(decoder): cache},
    ).last_hidden_state  # (b, R-1, d)
    return torch.cat([last, rest], dim=1)


@torch.no_grad()
def shared_prompt_is_exact(model: nn.Module, device: torch.device) -> bool:
    """Whether ``shared_prompt_hidden`` equals the plain forward for this model, on a probe of three
    rows (two share a prompt; one prompt is left-padded; responses of different lengths).

    Models whose cache is not a plain per-layer key/value store (recurrent state, cross-layer sharing)
    fail or raise here and keep the plain forward. Sliding-window attention (Mistral, Qwen2 with
    use_sliding_window, Gemma's local layers) keeps the shortcut: transformers' sliding cache layers
    keep the keys the window needs and build the window's mask from cache positions, so prompt + cached
    responses see what the full forward sees. The probe's 11 tokens reach no real window (4096, 512...);
    tests/trainer/model/test_hidden.py runs windows of 4 on sequences 5x longer, and the same code serves any.
    """
    hf = cast("PreTrainedModel", model)
    decoder = hf.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        return False
    vocab = int(hf.get_output_embeddings().weight.shape[0])
    p, r = 6, 5
    ids = (torch.arange(3 * (p + r), device=device).view(3, p + r) * 7919 + 11) % vocab
    ids[1, :p] = ids[0, :p]  # rows 0 and 1 share a prompt
    mask = torch.ones_like(ids)
    mask[2, :2] = 0  # row 2: a 4-token prompt, left-padded
    mask[1, p + 3 :] = 0  # responses of 5, 3 and 4 tokens, right-padded
    mask[2, p + 4 :] = 0
    ids = ids * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    was_training = model.training
    model.eval()
    try:
        full = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        expected = full.last_hidden_state[:, p - 1 : p + r - 1].float()  # (3, R, d)
        shared = shared_prompt_hidden(decoder, ids, mask, positions, p, r)
    except Exception as exc:  # an architecture whose cache cannot be indexed or extended this way
        log.info("actor.shared_prompt_forward_off", model=type(model).__name__, error=repr(exc)[:200])
        return False
    finally:
        model.train(was_training)
    if shared is None:
        return False
    valid = mask[:, p : p + r].bool()  # (3, R) the positions that score real response tokens
    error = float(
        (shared.float() - expected)[valid].abs().max() / expected[valid].abs().max().clamp(min=1e-6)
    )
    exact = error <= _SHARED_PROMPT_REL_TOL
    if not exact:
        log.info(
            "actor.shared_prompt_forward_off", model=type(model).__name__, relative_error=round(error, 4)
        )
    return exact


def head_rounding_bound(
    hidden: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM-head shortcut's float32 logits ``hidden @ weight.T`` (n, c), for ``hidden`` (n, d) and head
    rows ``weight`` (c, d) in float32, and how far an exact model's logits may be from them (n, c).

    The model's head sums the same d products h_i W_ji, accumulated in float32 (bf16 GEMMs accumulate in
    float32 too, on CPUs and GPUs) in its own order, then rounds the sum once to its logits' dtype. Each
    of the two sums, in whatever order its kernel takes (AVX2 or AVX-512 blocks, a GPU's tiles), is off by
    about sqrt(d) u32 of the terms' absolute sum (d roundings of either sign; all of one sign, d u32, is
    the contrived worst case), so

        |logit - shortcut| <= u_out |shortcut| + 2 sqrt(d) u32 (1 + u_out) sum_i |h_i W_ji|

    with u the unit roundoff (float32 2^-24, bf16 2^-8). Measured: 0 (the same bits) on CPU and on an H200
    in float32 and TF32; with bf16 weights up to 0.98 of the bound (d 2048-8192, V 32k-152k).

    A logit scale s moves a logit by |s - 1| |logit|. 1% is 1.7e5 u32: caught at every logit whose
    products' absolute sum is under 84,000 / sqrt(d) times the logit, all but near-cancelling ones (a
    random logit's is about sqrt(d) / 1.6); the H200's models above were 75-340x over the bound. 1% is
    2.6 u_bf16: caught wherever the scaled bf16 logit's rounding leaves more than u_bf16 of it (4x over
    the bound above); a scale under 2 u_bf16 = 0.78% can hide in bf16 rounding.
    """
    u_out = torch.finfo(logits_dtype).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    shortcut = hidden @ weight.T  # (n, c)
    products = hidden.abs() @ weight.abs().T  # (n, c): sum_i |h_i W_ji|
    d = hidden.shape[-1]
    return shortcut, u_out * shortcut.abs() + 2 * d**0.5 * u32 * (1 + u_out) * products


@torch.no_grad()
def head_shortcut_is_exact(model: nn.Module, device: torch.device) -> bool:
    """Whether ``decoder(x) @ head.weight.T`` (the LM-head shortcut) equals ``model(x).logits`` up to the
    rounding of the head's sums (``head_rounding_bound``) at every logit.

    Checked once on a probe of a few tokens, because models scale their logits in ways no common
    config key names (Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``, MiniCPM's
    ``dim_model_base``...); a model that fails takes the plain full forward, which is always right.
    """
    hf = cast("PreTrainedModel", model)
    head = hf.get_output_embeddings()
    decoder = hf.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or type(head) is not nn.Linear or head.bias is not None:
        return False
    vocab = int(head.weight.shape[0])
    ids = (torch.arange(_PROBE_TOKENS, device=device) * 7919 + 11) % vocab  # spread over the vocabulary
    kwargs = {
        "input_ids": ids[None],
        "attention_mask": torch.ones_like(ids)[None],
        "position_ids": torch.arange(_PROBE_TOKENS, device=device)[None],
        "use_cache": False,
    }
    was_training = model.training
    model.eval()
    try:
        logits = model(**kwargs).logits[0]  # (n, V) in the model's dtype
        hidden = decoder(**kwargs).last_hidden_state[0].float()  # (n, d)
    finally:
        model.train(was_training)
    # max over logits of |logit - shortcut| / head_rounding_bound (<= 1: exact), a vocabulary chunk at a time
    tiny = torch.finfo(torch.float32).tiny  # a zero bound (h = 0) admits only a zero difference
    worst = torch.zeros((), device=hidden.device)
    for start in range(0, vocab, _PROBE_VOCAB_CHUNK):
        weight = head.weight[start : start + _PROBE_VOCAB_CHUNK].float()  # (c, d)
        shortcut, bound = head_rounding_bound(hidden, weight, logits.dtype)  # (n, c) each
        diff = (logits[:, start : start + weight.shape[0]].float() - shortcut).abs()
        worst = torch.maximum(worst, (diff / bound.clamp(min=tiny)).max())
    ratio = float(worst)  # note: a CPU-GPU sync, once per model
    exact = ratio <= 1.0
    if not exact:
        log.info(
            "actor.lm_head_shortcut_off", model=type(model).__name__, over_rounding_bound=f"{ratio:.3g}x"
        )
    return exact
