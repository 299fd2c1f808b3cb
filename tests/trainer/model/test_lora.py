"""LoRA through peft: only the adapter trains, the engine gets merged weights under the base names,
and a checkpoint (the trainer worker's save/load) restores the adapter and its optimizer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch.engine import TorchEngine
from agentloop.errors import ConfigError
from agentloop.types import Triplet
from tests.trainer.samples import small_batch
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.distributed.worker import TrainerWorker
from trainer.model.actor import Actor

ADAPTED = "model.layers.0.self_attn.q_proj.weight"  # a linear layer "all-linear" adapts
FROZEN = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")  # never adapted


def _config(model_dir: Path, model: dict[str, Any] | None = None, **actor: Any) -> TrainerConfig:
    return TrainerConfig.from_dict(
        {
            "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": 16},
            "actor_rollout_ref": {
                "model": {"path": str(model_dir), "lora_rank": 4, **(model or {})},
                "rollout": {"n": 2},
                "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}, **actor},
            },
            "trainer": {"device": "cpu"},
        }
    )


def _split(actor: Actor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, adapter) tensors of the peft model, cloned."""
    base, adapter = {}, {}
    for k, v in actor.model.state_dict().items():
        (adapter if ".lora_" in k else base)[k] = v.detach().clone()
    return base, adapter


@pytest.fixture(scope="module")
def base_state(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_update_trains_only_the_adapter(tiny_model_dir: Path, checkpointing: bool) -> None:
    cfg = _config(tiny_model_dir, {"enable_gradient_checkpointing": checkpointing})
    actor = Actor(cfg, tiny_model_dir, "cpu")
    assert any(getattr(m, "gradient_checkpointing", False) for m in actor.model.modules()) == checkpointing
    trainable = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in actor.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in actor.model.parameters() if p.requires_grad
    }
    base0, adapter0 = _split(actor)
    metrics = actor.update(small_batch())
    actor.update(small_batch())  # lora_B starts at 0, so lora_A gets its first gradient on the second step
    base1, adapter1 = _split(actor)
    assert metrics["actor/grad_norm"] > 0
    assert base1.keys() == base0.keys() and all(torch.equal(base0[k], base1[k]) for k in base0)
    changed = [k for k in adapter0 if not torch.equal(adapter0[k], adapter1[k])]
    assert sorted(changed) == sorted(adapter0)  # every lora_A and lora_B moved


def test_named_weights_are_the_base_models_merged(tiny_model_dir: Path, base_state: Any) -> None:
    actor = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu")
    before = actor.named_weights()
    assert list(before) == list(base_state)  # the base model's names, in its order: no peft prefixes
    assert all(
        before[k].shape == base_state[k].shape and before[k].dtype == base_state[k].dtype for k in before
    )
    assert all(torch.equal(before[k], base_state[k]) for k in before)  # lora_B starts at 0: no change yet

    actor.update(small_batch())
    after = actor.named_weights()
    assert list(after) == list(base_state)
    assert not torch.equal(after[ADAPTED], base_state[ADAPTED])
    assert all(torch.equal(after[k], base_state[k]) for k in FROZEN)
    # the same as peft's own merge, and the actor's model is left as it was (still a peft model)
    reference = copy.deepcopy(actor.model).merge_and_unload().state_dict()
    for k in after:
        torch.testing.assert_close(after[k], reference[k], atol=1e-6, rtol=1e-6)
    assert any(".lora_B." in k for k in actor.model.state_dict())
    assert all(after[k].device.type == "cpu" and not after[k].requires_grad for k in after)


def test_the_engine_loads_the_merged_weights(tiny_model_dir: Path) -> None:
    """After update_weights the engine's logprobs are the LoRA policy's logprobs."""
    actor = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu")
    for _ in range(3):
        actor.update(small_batch())
    weights = actor.named_weights()

    async def sample() -> tuple[list[int], list[int], list[float], int]:
        engine = TorchEngine(tiny_model_dir, device="cpu")
        try:
            with anyio.fail_after(60):
                version = await engine.update_weights(weights)
            prompt = list(
                engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi there"}], add_generation_prompt=True, return_dict=False
                )
            )
            with anyio.fail_after(60):
                out = await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=3))
        finally:
            await engine.stop()
        return prompt, out.token_ids, out.logprobs or [], version

    prompt, response, engine_lp, version = anyio.run(sample)
    assert version == 1
    batch, _ = build_batch(
        [Triplet(prompt_ids=prompt, response_ids=response, reward=0.0)],
        max_prompt_length=64,
        max_response_length=16,
    )
    trained = actor.compute_logprobs(batch)[0, : len(response)]
    # the engine's forward has other shapes (one-token decode, prefix reuse) and merged W + s * B @ A (rank 4)
    # for peft's adapter path: each logit comes out of ~1150 fp32 products summed along the tiny model's path
    # (2 layers x (4 x 64 + T + 2 x 64 + 128) + 64 in the head), typical error sqrt(1150) * eps * |logit|,
    # |logit| <= 20; a log-prob moves by twice that
    lp_atol = 2 * 1150**0.5 * torch.finfo(torch.float32).eps * 20
    torch.testing.assert_close(trained, torch.tensor(engine_lp), atol=lp_atol, rtol=0)
    untrained = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu").compute_logprobs(batch)[
        0, : len(response)
    ]
    assert (trained - untrained).abs().max() > 1e-3  # the comparison would be void if training moved nothing


def test_a_checkpoint_roundtrip_restores_adapter_optimizer_and_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(tiny_model_dir)
    worker = TrainerWorker(cfg, str(tiny_model_dir), "cpu")
    worker.update(small_batch())
    path = tmp_path / "global_step_1"
    path.mkdir()
    worker.save_checkpoint(str(path))  # what a checkpoint writes: model.safetensors + optimizer.pt

    resumed = TrainerWorker(cfg, str(tiny_model_dir), "cpu")
    assert resumed.load_checkpoint(str(path)) == 1
    saved, loaded = worker.actor.named_weights(), resumed.actor.named_weights()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert (
        resumed.actor.optimizer.state_dict()["state"].keys()
        == worker.actor.optimizer.state_dict()["state"].keys()
    )
    # the next step is the same on both: Adam's moments came back too
    worker.update(small_batch())
    resumed.update(small_batch())
    a, b = worker.actor.named_weights(), resumed.actor.named_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)

    full = TrainerWorker(_config(tiny_model_dir, {"lora_rank": 0}), str(tiny_model_dir), "cpu")
    with pytest.raises(ValueError, match=r"written with actor_rollout_ref.model.lora_rank=4, this run has 0"):
        full.load_checkpoint(str(path))


def test_target_modules_that_match_nothing_name_the_layers(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"target_modules=\['attn_q'\] does not fit this model.*'q_proj'"):
        Actor(_config(tiny_model_dir, {"target_modules": ["attn_q"]}), tiny_model_dir, "cpu")
    actor = Actor(_config(tiny_model_dir, {"target_modules": ["q_proj", "v_proj"]}), tiny_model_dir, "cpu")
    adapted = {k.split(".lora_")[0] for k in actor.model.state_dict() if ".lora_" in k}
    assert {k.rsplit(".", 1)[-1] for k in adapted} == {"q_proj", "v_proj"}


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"lora_rank": -1}, r"actor_rollout_ref.model.lora_rank: .*greater than or equal to 0; got -1"),
        ({"lora_rank": True}, r"actor_rollout_ref.model.lora_rank: must be an integer, got True"),
        ({"lora_rank": 2.5}, r"actor_rollout_ref.model.lora_rank: .*valid integer"),
        ({"lora_alpha": 0}, r"actor_rollout_ref.model.lora_alpha: .*greater than or equal to 1; got 0"),
        ({"target_modules": []}, r"actor_rollout_ref.model.target_modules: must be 'all-linear'.*got \[\]"),
        (
            {"target_modules": ["q_proj", ""]},
            r"target_modules: must be .*non-empty list.*got \['q_proj', ''\]",
        ),
        ({"target_modules": 7}, r"actor_rollout_ref.model.target_modules: must be .*; got 7$"),
        ({"lora_rnk": 4}, r"unknown key 'actor_rollout_ref.model.lora_rnk'; did you mean 'lora_rank'\?"),
    ],
)
def test_bad_lora_values_are_config_errors(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainerConfig.from_dict({"actor_rollout_ref": {"model": model}})


def test_lora_overrides_parse() -> None:
    cfg = TrainerConfig().with_overrides(
        ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]
    )
    assert cfg.actor_rollout_ref.model.lora_rank == 8
    assert cfg.actor_rollout_ref.model.target_modules == ["q_proj", "v_proj"]


def test_the_kl_reference_stays_the_base_model(tiny_model_dir: Path) -> None:
    actor = Actor(_config(tiny_model_dir, use_kl_loss=True, kl_loss_coef=0.1), tiny_model_dir, "cpu")
    assert actor.ref is not None and not any(p.requires_grad for p in actor.ref.parameters())
    batch = small_batch()
    start = actor.compute_logprobs(batch)
    for _ in range(2):
        metrics = actor.update(small_batch())
    assert "actor/kl_loss" in metrics and metrics["actor/kl_loss"] > 0  # the policy has left the reference
    torch.testing.assert_close(actor.compute_logprobs(batch, actor.ref), start)
    assert (actor.compute_logprobs(batch) - start).abs().max() > 1e-4
