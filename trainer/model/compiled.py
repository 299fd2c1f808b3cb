"""torch.compile for the policy's decoder layers, with every recompile paid before the first step.

Compiled layers (dynamic shapes) compile again whenever a micro-batch fails a guard they hold:
- grad mode on (the update) or off (old, reference and value log-probs), autocast on or off;
- one row or several: dynamo specialises a size of 1;
- an attention mask or none: transformers passes no mask when nothing in a micro-batch is padding, so
  SDPA can take its causal path, and that is another graph;
- guards inductor adds on sizes: the width a multiple of 8 or not (alignment), rows x width below or
  above a fusion threshold (on an H100, Qwen2-0.5B: 5,242,880 / 896 = 5,852 tokens).

Each compile cost 3-26 s of an H100 update in the middle of a run (benchmarks/async_bench.py: 17.6 s
at step 1, 9.2 s at step 2, 4.0 s at step 8; 26.3 s at step 1 a run earlier), and past dynamo's limit of 8 graphs a frame runs
eagerly. So ``model_inputs`` gives the layers a mask and a width that is a multiple of 8 (padding
columns), and ``warm_up`` runs micro-batches of one row and of several, with and without grad, at
widths doubling up to the largest the run can bring, when the actor is built (the policy, the
reference model and the critic). ``compile_layers`` sets two process-wide settings for every
torch.compile of the trainer's process: dynamo's recompile limit (64) and no duck sizing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from trainer.batch import Batch, HostRows

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

# what torch.compile compiles with; tests set "eager" (dynamo's guards and recompiles, no inductor)
BACKEND = "inductor"

WIDTH_MULTIPLE = 8  # model_inputs pads a micro-batch's width to a multiple of this
RECOMPILE_LIMIT = 64  # graphs per compiled frame (dynamo's default, 8, is below what warm_up compiles)
_FIRST_WIDTH = 16

# a warm-up pass: (micro-batch, grad) -> the tensors a backward starts from, each (rows, response tokens)
Run = Callable[[Batch, bool], list[torch.Tensor]]


def enabled(use_torch_compile: bool, device: torch.device) -> bool:
    """Whether to compile: inductor on CUDA only; another ``BACKEND`` (tests) on any device."""
    return use_torch_compile and (device.type == "cuda" or BACKEND != "inductor")


def compile_layers(model: nn.Module) -> None:
    """torch.compile each decoder layer in place (the layers share one compiled graph): of a causal LM
    (``model.model.layers``, peft's base model too) or of the critic's value model (``decoder.layers``)."""
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model  # peft
    decoder = getattr(base, "decoder", None) or getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
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
    if extra == 0 and mb.fully_real():
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


def warm_up(
    run: Run,
    model: nn.Module,
    device: torch.device,
    max_tokens: int,
    max_width: int,
    grad: bool = True,
) -> int:
    """Run the kinds of micro-batch a model meets through ``run(mb, grad)`` so that the compiles happen
    now: several rows at widths 16, 32, ... while rows x width stays within ``max_tokens`` (the token
    budget), and one row at widths 16, 32, ... up to ``max_width`` (the longest sample). Each shape runs
    once in eval mode without grad (log-probs, values) and, with ``grad``, once in train mode followed by
    a backward from ``run``'s tensors (the update). Gradients are dropped and the random state is left
    as it was (a training-mode pass may draw dropout masks). Returns the number of passes run."""
    vocab_size = input_vocab_size(model)
    was_training = model.training
    passes = 0
    cuda = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=cuda):
        for rows, width in warm_up_shapes(max_tokens, max_width):
            mb = _probe_batch(rows, width // 2, width - width // 2, vocab_size, device)
            model.eval()
            with torch.no_grad():
                run(mb, False)
            passes += 1
            if not grad:
                continue
            model.train()
            outs = run(mb, True)
            # weights: a real loss's gradient is a full tensor, not the stride-0 one of a plain sum()
            weights = torch.linspace(0.5, 1.5, outs[0].numel(), device=device).view_as(outs[0])
            loss = sum((out * weights).sum() for out in outs)
            cast(torch.Tensor, loss).backward()
            passes += 1
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return passes


def input_vocab_size(model: nn.Module) -> int:
    """The rows of ``model``'s input embedding (a causal LM, a peft model, or the critic's value model)."""
    owner = cast("PreTrainedModel", getattr(model, "decoder", model))
    return int(cast(torch.Tensor, owner.get_input_embeddings().weight).shape[0])


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
        host_rows=HostRows((p,) * rows, (r,) * rows, tuple(range(rows)), tuple(range(rows))),
    )
