"""Data-parallel training: 2 gloo ranks (Ray actors, FSDP2) take the same step as one Actor."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from agentloop.types import Triplet
from trainer.actor import Actor
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.dp import DataParallelGroup, balance_by_tokens


def _config(
    model_dir: Path, token_budget: int, estimator: str = "grpo", reshard_after_forward: bool = True
) -> TrainerConfig:
    return TrainerConfig.from_dict(
        {
            "algorithm": {"adv_estimator": estimator},
            "critic": {"optim": {"lr": 1e-3, "weight_decay": 0.0}, "ppo_max_token_len_per_gpu": token_budget},
            "data": {"train_batch_size": 3, "max_prompt_length": 32, "max_response_length": 16},
            "actor_rollout_ref": {
                "model": {"path": str(model_dir)},
                "rollout": {"n": 2},
                "actor": {
                    "ppo_mini_batch_size": 3,
                    "ppo_max_token_len_per_gpu": token_budget,
                    "optim": {"lr": 1e-3, "weight_decay": 0.0},
                    "grad_clip": 1.0,
                    "entropy_coeff": 0.01,
                    "fsdp_config": {"reshard_after_forward": reshard_after_forward},
                },
            },
            "trainer": {"device": "cpu"},
        }
    )


def _triplets() -> list[Triplet]:
    rng = random.Random(0)
    out = []
    for i in range(6):  # lengths differ, so ranks get different row counts and micro-batch counts
        prompt = [rng.randrange(3, 49152) for _ in range(2 + 3 * i)]
        response = [rng.randrange(3, 49152) for _ in range(1 + (i * 5) % 9)]
        out.append(
            Triplet(
                prompt_ids=prompt,
                response_ids=response,
                reward=float(i % 3 == 0),
                metadata={"group_id": i // 2},
            )
        )
    return out


def test_balance_by_tokens_is_greedy_and_deterministic() -> None:
    parts = balance_by_tokens([10, 1, 9, 2, 8, 3], 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    totals = [sum([10, 1, 9, 2, 8, 3][i] for i in p) for p in parts]
    assert abs(totals[0] - totals[1]) <= 1, totals
    assert parts == balance_by_tokens([10, 1, 9, 2, 8, 3], 2)
    assert balance_by_tokens([5], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balance_by_tokens([1], 0)


@pytest.mark.e2e
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_two_ranks_take_the_same_step_as_one(
    tiny_model_dir: Path, ray_local: None, reshard_after_forward: bool
) -> None:
    """Also with parameters kept gathered from forward to backward: fewer all-gathers, the same step."""
    # several micro-batches per rank, uneven counts
    cfg = _config(tiny_model_dir, token_budget=40, reshard_after_forward=reshard_after_forward)
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    single = Actor(cfg, tiny_model_dir, "cpu")
    before = single.named_weights()
    m1 = single.update(batch)
    expected = single.named_weights()

    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        import anyio

        async def step() -> tuple[dict[str, float], dict[str, torch.Tensor]]:
            metrics = await group.update.remote(batch)
            return metrics, await group.named_weights.remote()

        m2, got = anyio.run(step)
    finally:
        group.shutdown()
    assert got.keys() == expected.keys()
    moved = max(float((expected[k] - before[k]).abs().max()) for k in expected)
    assert moved > 5e-4, "the update must move the weights for the comparison to mean something"
    # Tolerances from the computation, not from one CPU. The two runs sum the same fp32 terms in other
    # orders, so their clipped gradients differ by up to `noise`: typical error sqrt(n) * eps * M of the
    # sums over the n tokens and, inside each term, over V = 49152 logits, of terms up to the clipped
    # norm M = grad_clip = 1 (test_actor's micro-batch test has the same bound). One AdamW step
    # from zero state moves a weight by lr * g / (|g| + adam_eps): the full lr unless |g| is tiny, so a
    # gradient within `noise` of 0 may flip sign (steps 2 * lr apart) while a larger one barely moves it.
    eps, lr, adam_eps = torch.finfo(torch.float32).eps, 1e-3, 1e-8  # the config's lr, AdamW's eps
    noise = (int(batch.attention_mask.sum()) ** 0.5 + 49152**0.5) * eps * 1.0
    assert m1["actor/optimizer_steps"] == 1, "the bound below is for one Adam step"
    for k in expected:
        rounding = 2 * eps * (expected[k].abs() + 8 * lr)  # w + step rounded (1 ulp), ~8 ops in the step; x2
        r = ((expected[k] - before[k]).abs() - rounding).clamp(min=0) / lr  # <= |g| / (|g| + adam_eps)
        g = adam_eps * r / (1 - r).clamp(min=eps)  # a lower bound on the weight's |g|
        # |g| > noise keeps its sign: the steps differ by lr * (d/dg of g / (|g| + adam_eps)) * noise at most
        same_sign = lr * adam_eps * noise / ((g + adam_eps) * (g - noise + adam_eps))
        bound = torch.where(g > noise, same_sign.clamp(max=2 * lr), 2 * lr) + rounding
        excess = (got[k] - expected[k]).abs() - bound
        i, worst = int(excess.argmax()), float(excess.max())
        assert worst <= 0, (
            f"{k}: 2 ranks {got[k].flatten()[i]} vs 1 rank {expected[k].flatten()[i]} (bound {bound.flatten()[i]})"
        )
    # entropy (4.35): per-token error <= eps * M * (M + log2 V) ~ 4e-4 at logit scale M ~ 50 (see test_actor),
    # 1e-4 relative; grad_norm: relative error ~ sqrt(V) * eps = 3e-5; pg_loss ~ 0 (GRPO advantages cancel):
    # a mean of |A| <= 1 over the response tokens, summed in another order: error <= n * eps
    pg_atol = int(batch.response_mask.sum()) * eps
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=pg_atol), key


@pytest.mark.e2e
def test_two_ranks_train_the_critic_as_one(tiny_model_dir: Path, ray_local: None) -> None:
    """PPO with a critic (gae): the sharded critic's values, loss and update equal one device's."""
    cfg = _config(tiny_model_dir, token_budget=40, estimator="gae")
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    single = Actor(cfg, tiny_model_dir, "cpu")
    one = [single.update(batch) for _ in range(2)]
    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        import anyio

        async def steps() -> list[dict[str, float]]:
            return [await group.update.remote(batch) for _ in range(2)]

        two = anyio.run(steps)
    finally:
        group.shutdown()
    # step 1 starts from the zero head: values 0, loss 0.5 * mean(G^2); step 2's values come from the
    # critic each side trained in step 1, so equal values there mean equal critic updates. fp32 sums in
    # other orders: relative error ~ sqrt(n) * eps per value, far under 1e-4
    assert one[0]["critic/values_mean"] == two[0]["critic/values_mean"] == 0.0
    assert abs(one[1]["critic/values_mean"]) > 1e-4, (
        "the critic must move for the comparison to mean something"
    )
    for key in (
        "critic/vf_loss",
        "critic/values_mean",
        "critic/returns_mean",
        "critic/grad_norm",
        "critic/vf_clipfrac",
    ):
        for a, b in zip(one, two, strict=True):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_lora_is_refused_with_a_clear_error(tiny_model_dir: Path) -> None:
    import torch.distributed as dist

    from trainer.dp import ShardedActor

    cfg = TrainerConfig.from_dict(
        {
            "actor_rollout_ref": {"model": {"path": str(tiny_model_dir), "lora_rank": 4}},
            "trainer": {"device": "cpu"},
        }
    )
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="does not support LoRA"):
        ShardedActor(cfg, str(tiny_model_dir), "cpu", 0, 1)


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_ranks_checkpoint_in_safetensors_and_resume_the_same_step(
    tiny_model_dir: Path, ray_local: None, tmp_path: Path, estimator: str
) -> None:
    """2 ranks write a checkpoint as one device does (model.safetensors + optimizer.pt, no actor.pt) and
    the final model as a Hugging Face folder; a fresh group resumes from it and takes the same next step."""
    import anyio
    from transformers import AutoModelForCausalLM

    cfg = _config(tiny_model_dir, token_budget=40, estimator=estimator)
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    path, final = tmp_path / "global_step_1", tmp_path / "final_model"
    path.mkdir()

    async def first() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
        await group.update.remote(batch)
        await group.save_checkpoint.remote(str(path))
        await group.save_model.remote(str(tiny_model_dir), str(final), None)
        saved = await group.named_weights.remote()
        metrics = await group.update.remote(batch)
        return saved, await group.named_weights.remote(), metrics

    async def resumed() -> tuple[int, dict[str, torch.Tensor], dict[str, float]]:
        step = await group.load_checkpoint.remote(str(path))
        metrics = await group.update.remote(batch)
        return step, await group.named_weights.remote(), metrics

    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        saved, expected, going_on = anyio.run(first)
    finally:
        group.shutdown()
    files = ["model.safetensors", "optimizer.pt"] + (["critic"] if estimator == "gae" else [])
    assert sorted(p.name for p in path.iterdir()) == sorted(files)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved if k in model.state_dict())
    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        step, got, again = anyio.run(resumed)
    finally:
        group.shutdown()
    assert step == 1
    # the same ranks, the same data, the same restored weights and Adam moments: the same step exactly
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    if estimator == "gae":  # the critic too: the same values, loss and update after the resume
        for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/pg_loss"):
            assert again[key] == going_on[key], key


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shard_keeps_gathered_parameters_only_when_asked(
    tiny_model_dir: Path, reshard_after_forward: bool
) -> None:
    """After a forward, FSDP2 leaves a layer's parameters gathered (plain tensors) only with
    reshard_after_forward=False; resharded ones are DTensor shards again."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.actor import load_policy
    from trainer.dp import shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = load_policy(tiny_model_dir, torch.device("cpu"))
        layers = model.model.layers
        shard(model, layers, reshard_after_forward)
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        gathered = not isinstance(layers[0].self_attn.q_proj.weight, DTensor)
        assert gathered is (not reshard_after_forward)
    finally:
        dist.destroy_process_group()
