"""Compiled decoder layers: the warm-up pays every compile, so no update recompiles mid-run.

Runs dynamo with its "eager" backend: the same guards and recompiles as inductor on a GPU, without
generating kernels (fast on a CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
from torch._dynamo.utils import counters

from agentloop.types import Triplet
from tests.trainer.samples import actor_config, small_batch
from trainer.batch import Batch, build_batch
from trainer.config import TrainerConfig
from trainer.model import compiled
from trainer.model.actor import Actor


@pytest.fixture
def eager_dynamo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    # compile_layers raises these process-wide settings: give them back after the test
    limit, duck = torch._dynamo.config.recompile_limit, torch.fx.experimental._config.use_duck_shape
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit, torch.fx.experimental._config.use_duck_shape = limit, duck


def _compiled_actor(model_dir: Path) -> Actor:
    """An Actor on the CPU that compiles (and warms up) as it does on a GPU: the eager backend."""
    actor = Actor(actor_config(model_dir, ppo_max_token_len_per_gpu=256), model_dir, "cpu")
    assert actor.compiled and not actor.shared_prompts  # the per-layer cache of shared prompts recompiles
    return actor


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _unpadded(rows: int, prompt: int, response: int) -> Batch:
    """``rows`` samples of one prompt and response length each: no token of the batch is padding."""
    triplets = [
        Triplet(
            prompt_ids=[3 + i + j for j in range(prompt)],
            response_ids=[40 + i + j for j in range(response)],
            reward=float(i % 2),
            metadata={"group_id": 0},
        )
        for i in range(rows)
    ]
    batch, _ = build_batch(triplets, max_prompt_length=32, max_response_length=32)
    return batch


def _runs(actor: Actor) -> None:
    """What updates bring: padded and unpadded micro-batches of one row and of several, log-probs
    (no grad) and forward + backward (grad)."""
    for batch in (
        small_batch(),
        _unpadded(1, 5, 7),
        _unpadded(2, 9, 4),
        _unpadded(1, 11, 13),
        _unpadded(4, 6, 6),
    ):
        actor.compute_logprobs(batch)  # eval mode, no grad
        actor.model.train()  # as Actor.update
        logprobs, entropy = actor._forward(actor.model, batch, True)
        weights = batch.response_mask / batch.response_mask.sum()  # a token-mean loss, as Actor.update's
        assert entropy is not None
        ((logprobs * weights).sum() - 0.0 * (entropy * weights).sum()).backward()  # entropy_coeff 0
    actor.model.zero_grad(set_to_none=True)


@pytest.mark.usefixtures("eager_dynamo")
def test_no_update_compiles_after_the_warm_up(tiny_model_dir: Path) -> None:
    actor = _compiled_actor(tiny_model_dir)  # warms up when built
    warmed = _graphs()
    assert warmed > 0, "the warm-up compiled nothing: the test would prove nothing"
    assert all(p.grad is None for p in actor.model.parameters())  # the warm-up's gradients are gone
    _runs(actor)
    metrics = actor.update(small_batch())  # and the real update: old log-probs, advantages, a step
    assert metrics["actor/active_samples"] > 0
    assert _graphs() == warmed, f"{_graphs() - warmed} graphs compiled after the warm-up"
    assert actor.warm_up_compiled() == 2 * len(compiled.warm_up_shapes(256, 48))


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.usefixtures("eager_dynamo")
def test_the_reference_model_and_the_critic_are_warmed_up_too(tiny_model_dir: Path) -> None:
    """PPO with a KL loss: the reference model's log-probs (frozen parameters: another guard) and the
    critic's values and update compile nothing after the warm-up either."""
    cfg = actor_config(tiny_model_dir, ppo_max_token_len_per_gpu=64, use_kl_loss=True).model_dump()
    cfg["algorithm"]["adv_estimator"] = "gae"
    actor = Actor(TrainerConfig.model_validate(cfg), tiny_model_dir, "cpu")
    assert actor.ref is not None and actor.critic is not None and actor.critic.compiled
    warmed = _graphs()
    for batch in (small_batch(), _unpadded(1, 5, 7), _unpadded(3, 6, 9)):
        metrics = actor.update(batch)
        assert "critic/vf_loss" in metrics and "actor/kl_loss" in metrics
    assert _graphs() == warmed, f"{_graphs() - warmed} graphs compiled after the warm-up"


@pytest.mark.usefixtures("eager_dynamo")
def test_without_the_warm_up_updates_compile(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the test above: the same runs compile when nothing warmed the layers up."""
    monkeypatch.setattr(Actor, "warm_up_on_init", False)
    actor = _compiled_actor(tiny_model_dir)
    assert _graphs() == 0
    _runs(actor)
    assert _graphs() > 0


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.usefixtures("eager_dynamo")
@pytest.mark.parametrize(("layers_per_unit", "without_fsdp"), [(1, False), (2, False), (1, True)])
def test_sharded_actor_warms_up_after_sharding(
    tiny_model_dir: Path, layers_per_unit: int, without_fsdp: bool
) -> None:
    """FSDP2 (1 gloo rank, in this process): the warm-up runs on the sharded model, no update compiles
    after it, and the padding columns and the head's positions give the plain Actor's log-probs; also
    with both decoder layers in one FSDP unit, and for the whole copy trained without FSDP2
    (``skip_fsdp_when_replicated``)."""
    import torch.distributed as dist

    from trainer.distributed.data_parallel import ShardedActor

    config = actor_config(tiny_model_dir, ppo_max_token_len_per_gpu=64, shared_prompt_forward=False)
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    config = config.with_overrides(
        [f"{fsdp}.layers_per_unit={layers_per_unit}", f"{fsdp}.skip_fsdp_when_replicated={without_fsdp}"]
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = ShardedActor(config, str(tiny_model_dir), "cpu", 0, 1)
        assert sharded.replicated == without_fsdp
        warmed = _graphs()
        assert sharded.compiled and warmed > 0
        _runs(sharded)
        assert _graphs() == warmed, f"{_graphs() - warmed} graphs compiled after the warm-up"
        plain_config = actor_config(tiny_model_dir, shared_prompt_forward=False, use_torch_compile=False)
        plain = Actor(plain_config, tiny_model_dir, "cpu")
        for batch in (small_batch(), _unpadded(1, 5, 7), _unpadded(3, 6, 10)):
            torch.testing.assert_close(
                sharded.compute_logprobs(batch), plain.compute_logprobs(batch), rtol=0, atol=1e-4
            )
    finally:
        dist.destroy_process_group()


def test_warm_up_shapes_reach_the_budget_and_the_longest_sample() -> None:
    # several rows: 2 and 3 in turn at doubling widths within 256 tokens; one row: to the longest (48)
    assert compiled.warm_up_shapes(256, 48) == [
        (2, 16),
        (3, 32),
        (2, 64),
        (2, 128),
        (1, 16),
        (1, 32),
        (1, 48),
    ]
    assert compiled.warm_up_shapes(300, 16) == [(2, 16), (3, 32), (2, 64), (2, 128), (2, 144), (1, 16)]


@pytest.mark.usefixtures("eager_dynamo")
def test_padding_columns_leave_the_logprobs(tiny_model_dir: Path) -> None:
    """The compiled layers get a width that is a multiple of 8 and always some padding; the response
    log-probs stay the same up to float rounding."""
    config = actor_config(tiny_model_dir, shared_prompt_forward=False, use_torch_compile=False)
    actor = Actor(config, tiny_model_dir, "cpu")
    unpadded = _unpadded(2, 9, 7)  # 16 columns, none of them padding
    assert bool(unpadded.attention_mask.all()) and unpadded.input_ids.shape[1] == 16
    wider = compiled.model_inputs(unpadded)
    assert wider.input_ids.shape[1] == 24 and not bool(wider.attention_mask[:, 16:].any())
    assert torch.equal(wider.input_ids[:, :16], unpadded.input_ids) and wider.responses.shape[1] > 7
    odd = small_batch()
    assert compiled.model_inputs(odd).input_ids.shape[1] == -(-odd.input_ids.shape[1] // 8) * 8
    aligned = compiled.model_inputs(odd)
    assert compiled.model_inputs(aligned) is aligned  # padded already and a multiple of 8
    widths: list[int] = []  # what the decoder got
    decoder = cast(torch.nn.Module, actor.model.model)
    decoder.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    for batch in (unpadded, _unpadded(1, 5, 6), odd):
        plain = actor.compute_logprobs(batch)
        actor.compiled = True  # model_inputs on, the layers left uncompiled: only the columns differ
        with_columns = actor.compute_logprobs(batch)
        actor.compiled = False
        assert widths[-2] == batch.input_ids.shape[1]  # plain: the micro-batch as it is
        assert widths[-1] == compiled.model_inputs(batch).input_ids.shape[1] and widths[-1] % 8 == 0
        # fp32 on the CPU: another matmul shape may round differently, ~1e-6 on log-probs of order 10
        torch.testing.assert_close(with_columns, plain, rtol=0, atol=1e-4)
