"""torch.compile for the policy's decoder layers, with every recompile paid before the first step.

Compiled layers (dynamic shapes) compile again whenever a micro-batch fails a guard they hold:
- grad mode on (the update) or off (old, reference and value log-probs);
- one row or several: dynamo specialises a size of 1;
- an attention mask or none: transformers passes no mask when nothing in a micro-batch is padding, so
  SDPA can take its causal path, and that is another graph;
- the first shape of each: it is compiled static, and again as dynamic when a second shape comes.

Each compile cost 5-20 s of an H100 update in the middle of a run (benchmarks/async_bench.py: 20.8 s
at step 2, 3.0 s at step 8, 11.6 s at step 16), and past dynamo's limit of 8 graphs a frame runs
eagerly. So ``model_inputs`` always gives the layers a mask (one padding column where a micro-batch
has none), and ``warm_up`` runs each remaining kind once (grad on and off, one row and several, two
shapes each) when the actor is built.
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

# (rows, prompt tokens, response tokens) of the warm-up micro-batches: two shapes of several rows
# (the second makes both dimensions dynamic), then one row twice
_WARM_UP_SHAPES = ((2, 8, 8), (3, 12, 20), (1, 8, 8), (1, 12, 20))

Forward = Callable[[nn.Module, Batch, bool], tuple[torch.Tensor, torch.Tensor | None]]


def compile_layers(model: nn.Module) -> None:
    """torch.compile each decoder layer in place (the layers share one compiled graph)."""
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model  # peft
    layers = getattr(getattr(base, "model", None), "layers", None)
    for layer in layers or []:
        layer.compile(dynamic=True, backend=BACKEND)


def model_inputs(mb: Batch) -> Batch:
    """``mb`` for the decoder: with one padding column appended when no token of it is padding, so
    the layers always get an attention mask. Causal attention keeps every earlier position's output
    as it was; the responses, their mask and ``prompt_length`` stay as they are."""
    if not bool(mb.attention_mask.all()):  # note: a CPU-GPU sync
        return mb
    rows = len(mb)
    pad = torch.zeros(rows, 1, dtype=mb.input_ids.dtype, device=mb.input_ids.device)  # (b, 1)
    return replace(
        mb,
        input_ids=torch.cat([mb.input_ids, pad], dim=1),
        attention_mask=torch.cat([mb.attention_mask, pad.to(mb.attention_mask.dtype)], dim=1),
        position_ids=torch.cat([mb.position_ids, pad.to(mb.position_ids.dtype)], dim=1),
    )


def warm_up(forward: Forward, model: nn.Module, device: torch.device) -> int:
    """Run every kind of micro-batch the actor meets through ``forward`` (its log-prob pass: no grad,
    eval mode; and the update's: grad, train mode, a backward) so that the compiles happen now; the
    gradients are dropped. Returns the number of passes run."""
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()
    vocab_size = int(cast(torch.Tensor, embeddings.weight).shape[0])
    was_training = model.training
    passes = 0
    for rows, p, r in _WARM_UP_SHAPES:
        mb = _probe_batch(rows, p, r, vocab_size, device)
        model.eval()
        with torch.no_grad():
            forward(model, mb, False)
        model.train()
        logprobs, entropy = forward(model, mb, True)
        loss = logprobs.sum() + (entropy.sum() if entropy is not None else 0.0)
        loss.backward()
        passes += 2
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return passes


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
