"""The decoder's attention mask built on the device: the mask transformers would build, and a forward
over padded rows that reads nothing back (transformers' own check reads the padding mask back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import sdpa_mask

from tests.trainer.model.test_compiled import eager_dynamo  # noqa: F401  (a fixture)
from tests.trainer.model.test_host_syncs import _batch, _ReadBacks
from tests.trainer.samples import actor_config
from trainer.model.actor import Actor
from trainer.model.attention_mask import EXACT_4D_MASK_MODELS, attention_mask_for


def _padding_mask() -> torch.Tensor:
    return torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 0],  # a left-padded prompt and a short response
            [1, 1, 1, 1, 1, 1, 1],
            [0, 1, 1, 1, 0, 0, 0],
        ]
    )


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(1) - 1).clamp(min=0)  # as build_batch numbers them


def _tiny(model_type: str, attn: str = "sdpa", **config: Any) -> PreTrainedModel:
    """A randomly initialised causal LM of ``model_type``, 2 small layers."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8)
    ids = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = AutoConfig.for_model(model_type, **sizes, **ids, num_key_value_heads=2, **config)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _llama(attn: str = "sdpa") -> PreTrainedModel:
    return _tiny("llama", attn, initializer_range=0.5)


def test_the_mask_is_the_one_transformers_builds() -> None:
    mask = _padding_mask()
    ours = attention_mask_for(_llama(), mask, fully_real=False)
    theirs = sdpa_mask(
        batch_size=3, q_length=7, kv_length=7, attention_mask=mask.bool(), allow_is_causal_skip=False
    )
    assert ours.shape == (3, 1, 7, 7) and ours.dtype == torch.bool
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("model_type", sorted(EXACT_4D_MASK_MODELS))
def test_every_listed_model_computes_the_same_bit_for_bit(model_type: str) -> None:
    model = _tiny(model_type, **({"sliding_window": None} if model_type == "mistral" else {}))
    mask = _padding_mask()
    prepared = attention_mask_for(model, mask, fully_real=False)
    assert prepared.dim() == 4  # the prepared mask is what runs
    ids = torch.randint(3, 128, mask.shape) * mask
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        ours = model(input_ids=ids, attention_mask=prepared, position_ids=_positions(mask)).logits
    real = mask.bool()
    assert torch.equal(ours[real], plain[real])


def _config_only(config: PretrainedConfig) -> nn.Module:
    """A module holding ``config`` (all the mask's choice reads)."""
    config._attn_implementation = "sdpa"
    holder = nn.Module()
    holder.config = config  # type: ignore[assignment]
    return holder


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: _llama("eager"), id="eager-attention"),
        pytest.param(
            lambda: _tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
            id="sliding-window",
        ),
        # Gemma 3's sliding layers are configured in its text config, not the top-level one
        pytest.param(lambda: _config_only(Gemma3Config()), id="composite-gemma3"),
        pytest.param(lambda: _tiny("gpt2", n_embd=32, n_layer=2, n_head=4), id="not-listed"),
    ],
)
def test_models_with_other_masks_get_the_padding_mask(model: Any) -> None:
    """A prepared 4D mask would replace a sliding window's own mask, and eager attention adds its mask."""
    mask = _padding_mask()
    assert attention_mask_for(model(), mask, fully_real=False) is mask


def test_a_batch_without_padding_keeps_the_causal_path() -> None:
    mask = torch.ones(2, 5, dtype=torch.long)
    # transformers finds no padding: SDPA's is_causal path
    assert attention_mask_for(_llama(), mask, fully_real=True) is mask


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_a_forward_over_padded_rows_reads_nothing_back(
    tiny_model_dir: Path, compile_layers: bool, request: pytest.FixtureRequest
) -> None:
    if compile_layers:
        request.getfixturevalue("eager_dynamo")  # compiles as on a GPU, without inductor
    actor = Actor(actor_config(tiny_model_dir, ppo_max_token_len_per_gpu=256), tiny_model_dir, "cpu")
    assert actor.compiled == compile_layers
    batch = _batch(8, seed=2)
    assert not batch.fully_real()
    counter = _ReadBacks(under=None)  # transformers' read-backs too
    with counter:
        logprobs, _ = actor._forward(actor.model, batch, entropy=True)
    assert counter.sites == {}, f"read-backs by site: {dict(counter.sites)}"
    assert torch.isfinite(logprobs[batch.response_mask.bool()]).all()
