"""torch.compile for the policy's decoder layers, with every recompile paid before the first step.

Compiled layers (dynamic shapes) compile again whenever a micro-batch fails a guard they hold:
- grad mode on (the update) or off (old, reference and value log-probs), autocast on or off;
- one row or several: dynamo specialises a size of 1;
- an attention mask or none: transformers passes no mask when nothing in a micro-batch is padding, so
  SDPA can take its causal path, and that is another graph;
- guards inductor adds on sizes: the width a multiple of 8 or not (alignment), rows x width below or
  above a fusion threshold (on an H100, Qwen2-0.5B: 5,242,880 / 896 = 5,852 tokens).

Each compile cost 3-18 s of an H100 update in the middle of a run (benchmarks/async_bench.py: 17.6 s
at step 1, 9.2 s at step 2, 4.0 s at step 8), and past dynamo's limit of 8 graphs a frame runs
eagerly. So ``model_inputs`` gives the layers a mask and a width that is a multiple of 8 (padding
columns), and ``warm_up`` runs micro-batches of one row and of several, with and without grad, at
widths doubling up to the largest the run can bring, when the actor is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from trainer.batch import Batch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

# what torch.compile compiles with; tests set "eager" (dynamo's guards and recompiles, no inductor)
BACKEND = "inductor"

WIDTH_MULTIPLE = 8  # model_inputs pads a micro-batch's width to a multiple of this
RECOMPILE_LIMIT = 64  # graphs per compiled frame (dynamo's default, 8, is below what warm_up compiles)
_FIRST_WIDTH = 16

Forward = Callable[[nn.Module, Batch, bool], tuple[torch.Tensor, torch.Tensor | None]]


def enabled(use_torch_compile: bool, device: torch.device) -> bool:
    """Whether to compile: inductor on CUDA only; another ``BACKEND`` (tests) on any device."""
    return use_torch_compile and (device.type == "cuda" or BACKEND != "inductor")


def compile_layers(model: nn.Module) -> None:
    """torch.compile each decoder layer in place (the layers share one compiled graph)."""
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model  # peft
    layers = getattr(getattr(base, "model", None), "layers", None)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # no guards from sizes that happen to be equal in one micro-batch (a chunk's offset and a width)
    torch.fx.experimental._config.use_duck_shape = False
    for layer in layers or []:
        layer.compile(dynamic=True, backend=BACKEND)


def model_inputs(mb: Batch) -> Batch:
    """``mb`` for the decoder: padding columns appended up to a width that is a multiple of 8, and at
    least one when no token of it is padding, so the layers always get an attention mask. Causal
    attention keeps every earlier position's output as it was; the responses, their mask and
    ``prompt_length`` stay as they are."""
    extra = -mb.input_ids.shape[1] % WIDTH_MULTIPLE
    if extra == 0 and bool(mb.attention_mask.all()):  # note: a CPU-GPU sync
        extra = WIDTH_MULTIPLE
    if extra == 0:
        return mb
    rows = len(mb)
    pad = torch.zeros(rows, extra, dtype=mb.input_ids.dtype, device=mb.input_ids.device)  # (b, extra)
    return replace(
        mb,
        input_ids=torch.cat([mb.input_ids, pad], dim=1),
        attention_mask=torch.cat([mb.attention_mask, pad.to(mb.attention_mask.dtype)], dim=1),
        position_ids=torch.cat([mb.position_ids, pad.to(mb.position_ids.dtype)], dim=1),
    )


def warm_up(forward: Forward, model: nn.Module, device: torch.device, max_tokens: int, max_width: int) -> int:
    """Run the kinds of micro-batch the actor meets through ``forward`` (its log-prob pass: no grad,
    eval mode; and the update's: grad, train mode, a backward) so that the compiles happen now:
    several rows at widths 16, 32, ... while rows x width stays within ``max_tokens`` (the token
    budget), and one row at widths 16, 32, ... up to ``max_width`` (the longest sample). The
    gradients are dropped. Returns the number of passes run."""
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()
    vocab_size = int(cast(torch.Tensor, embeddings.weight).shape[0])
    was_training = model.training
    passes = 0
    for rows, width in warm_up_shapes(max_tokens, max_width):
        mb = _probe_batch(rows, width // 2, width - width // 2, vocab_size, device)
        model.eval()
        with torch.no_grad():
            forward(model, mb, False)
        model.train()
        logprobs, entropy = forward(model, mb, True)
        # weights: a real loss's gradient is a full tensor, not the stride-0 one of a plain sum()
        weights = torch.linspace(0.5, 1.5, logprobs.numel(), device=device).view_as(logprobs)
        loss = (logprobs * weights).sum()
        if entropy is not None:
            loss = loss + (entropy * weights).sum()
        loss.backward()
        passes += 2
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return passes


def warm_up_shapes(max_tokens: int, max_width: int) -> list[tuple[int, int]]:
    """(rows, width) of the warm-up micro-batches: 2 and 3 rows in turn (so both sizes are dynamic)
    at doubling widths while they fit ``max_tokens``, then 1 row at doubling widths to ``max_width``;
    each list ends on its largest size."""
    shapes: list[tuple[int, int]] = []
    width = _FIRST_WIDTH
    while 2 * width <= max_tokens:
        rows = 3 if len(shapes) % 2 and 3 * width <= max_tokens else 2
        shapes.append((rows, width))
        width *= 2
    widest = max_tokens // 2 // WIDTH_MULTIPLE * WIDTH_MULTIPLE
    if widest >= _FIRST_WIDTH and (not shapes or shapes[-1][1] < widest):
        shapes.append((2, widest))
    width, longest = _FIRST_WIDTH, max(_FIRST_WIDTH, max_width)
    while width < longest:
        shapes.append((1, width))
        width *= 2
    shapes.append((1, longest))
    return shapes


def _probe_batch(rows: int, p: int, r: int, vocab_size: int, device: torch.device) -> Batch:
    """A micro-batch of ``rows`` unpadded rows of ``p + r`` tokens spread over the vocabulary."""
    width = p + r
    ids = (torch.arange(rows * width, device=device).reshape(rows, width) * 7919 + 11) % vocab_size
    ones = torch.ones(rows, width, dtype=torch.long, device=device)
    return Batch(
        input_ids=ids,
        attention_mask=ones,
        position_ids=torch.arange(width, device=device).expand(rows, width).contiguous(),
        response_mask=ones[:, p:],
        rewards=torch.zeros(rows, device=device),
        group_ids=torch.arange(rows, device=device),
        prompt_length=p,
    )
