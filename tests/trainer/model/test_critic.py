"""Issue 18, PPO with a critic: GAE over a multi-turn attempt computed by hand, the clipped value loss,
explained variance, the config rules, a real critic fitting returns, and checkpoint resume.

Real components: the tiny randomly initialised model with the real tokenizer for the Actor/Critic, the
real build_batch and adapter metadata; the GAE and loss cases are computed by hand in the comments.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from agentloop.adapter import spans_to_triplets
from agentloop.types import LLMCall, Reward, Span, Triplet
from tests.trainer.samples import actor_config
from trainer.algorithms import explained_variance, masked_whiten, value_loss
from trainer.batch import build_batch
from trainer.batch.advantages import attempt_gae
from trainer.config import TrainerConfig
from trainer.distributed.worker import TrainerWorker
from trainer.model.actor import Actor


def _attempt(merge: bool) -> tuple[list[Triplet], int]:
    """One attempt: call 1 answers [30, 31], a tool result [40, 41] comes back, call 2 answers [32];
    a reward 0.5 after call 1 and 1.0 after call 2. Returns the triplets and the tool tokens' offset."""
    p1 = [1, 2, 3]
    c1 = LLMCall(prompt_ids=p1, response_ids=[30, 31], response_logprobs=[-0.1, -0.2])
    c2 = LLMCall(prompt_ids=[*p1, 30, 31, 40, 41], response_ids=[32], response_logprobs=[-0.3])
    spans = [
        Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, payload=c1),
        Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=2, payload=Reward(value=0.5)),
        Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=3, payload=c2),
        Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=4, payload=Reward(value=1.0)),
    ]
    triplets = spans_to_triplets(spans, strategy="per_call").triplets
    assert [t.metadata["call_reward"] for t in triplets] == [0.5, 1.0]  # each call's own reward
    return triplets, 2


def _config(gamma: float = 1.0, lam: float = 1.0) -> TrainerConfig:
    return TrainerConfig.from_dict(
        {
            "algorithm": {"adv_estimator": "gae", "gamma": gamma, "lam": lam},
            "actor_rollout_ref": {"rollout": {"n": 1}},
        }
    )


@pytest.mark.parametrize("merge", [False, True])
def test_gae_runs_over_the_whole_attempt_with_each_turns_reward_on_its_last_token(merge: bool) -> None:
    triplets, _ = _attempt(merge)
    batch, _ = build_batch(triplets, max_prompt_length=16, max_response_length=16, merge=merge)
    # the attempt's model tokens in order: a1=30, a2=31 (call 1), b1=32 (call 2); V = 0.1, 0.2, 0.4
    values = torch.zeros(batch.response_mask.shape)
    model_tokens = batch.response_mask.bool()
    v = torch.tensor([0.1, 0.2, 0.4])
    values[model_tokens] = v
    if merge:  # one row a1 a2 [tool tool] b1: the tool tokens' values must not matter
        assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 1]
        values[0, 2:4] = 9.0
    # gamma = 1, lambda = 0.5; rewards r = 0, 0.5, 1.0 (call 1's own 0.5 on a2, call 2's 1.0 on b1)
    # deltas: b1 = 1.0 + 0 - 0.4 = 0.6; a2 = 0.5 + 0.4 - 0.2 = 0.7 (V(b1) bootstraps across the tool
    # result); a1 = 0 + 0.2 - 0.1 = 0.1. A: b1 = 0.6; a2 = 0.7 + 0.5 * 0.6 = 1.0; a1 = 0.1 + 0.5 * 1.0 = 0.6
    adv, returns = attempt_gae(batch, values, _config(lam=0.5))
    expected_adv = torch.tensor([0.6, 1.0, 0.6])
    torch.testing.assert_close(returns[model_tokens], expected_adv + v)  # returns = A + V = 0.7, 1.2, 1.0
    ones = torch.ones(3, dtype=torch.bool)
    torch.testing.assert_close(adv[model_tokens], masked_whiten(expected_adv, ones))
    assert not adv[~model_tokens].any() and not returns[~model_tokens].any()
    # per-call GAE (each call an episode of its own) would give a2 0.5 - 0.2 = 0.3, not 1.0: caught above
    # gamma = lambda = 1: every token's return is the rewards after it: 1.5, 1.5, 1.0
    _, returns = attempt_gae(batch, values, _config())
    torch.testing.assert_close(returns[model_tokens], torch.tensor([1.5, 1.5, 1.0]))


@pytest.mark.parametrize("merge", [False, True])
def test_a_call_that_is_not_trained_hands_its_reward_to_the_last_kept_token(merge: bool) -> None:
    triplets, _ = _attempt(merge=merge)
    # max_prompt_length 5 and a row of at most 5 + 2 tokens: call 2's prompt (7 tokens) is over the
    # limit, merged or not; it trains nothing, and its reward 1.0 goes on a2 with call 1's 0.5
    batch, stats = build_batch(triplets, max_prompt_length=5, max_response_length=2, merge=merge)
    assert stats["calls_prompt_too_long"] == 1 and batch.responses.tolist() == [[30, 31]]
    values = torch.zeros(batch.response_mask.shape)
    _, returns = attempt_gae(batch, values, _config())
    torch.testing.assert_close(returns[0], torch.tensor([1.5, 1.5]))  # 0.5 + 1.0 on a2, nothing lost


def test_hand_built_triplets_without_call_rewards_reward_the_last_call() -> None:
    meta = {"rollout_id": "r", "attempt_id": "a", "attempt_reward": 2.0}
    triplets = [
        Triplet(prompt_ids=[1], response_ids=[5, 6], reward=2.0, metadata={**meta, "call_index": 0}),
        Triplet(prompt_ids=[1, 5, 6, 7], response_ids=[8], reward=2.0, metadata={**meta, "call_index": 1}),
    ]
    batch, _ = build_batch(triplets, max_prompt_length=8, max_response_length=4)
    _, returns = attempt_gae(batch, torch.zeros(batch.response_mask.shape), _config())
    # the return 2.0 counted once (on the last call), not once per call (which would give 4.0 up front)
    assert returns[batch.response_mask.bool()].tolist() == [2.0, 2.0, 2.0]


def test_value_loss_clips_predictions_that_moved_too_far() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    vpreds = torch.tensor([[0.9, 0.1, 0.8]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1]])
    out = value_loss(vpreds, old, returns, mask, cliprange_value=0.2)
    # token 1: V 0.9 clipped to 0.2: (0.9-1)^2 = 0.01 < (0.2-1)^2 = 0.64 -> 0.64 (clipped, no gradient)
    # token 2: V 0.1 inside the range: (0.1-1)^2 = 0.81 both -> 0.81
    # token 3: V 0.8 clipped to 0.2: (0.8+1)^2 = 3.24 > (0.2+1)^2 = 1.44 -> 3.24 (unclipped)
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * (0.64 + 0.81 + 3.24) / 3))
    torch.testing.assert_close(out.clip_frac, torch.tensor(1 / 3))
    out.loss.backward()
    assert vpreds.grad is not None
    # d/dV 0.5 * mean: token 1 clipped (0), token 2: (0.1 - 1) / 3, token 3: (0.8 + 1) / 3
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, -0.9 / 3, 1.8 / 3]]))


def test_explained_variance() -> None:
    mask = torch.ones(1, 4, dtype=torch.bool)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == 0.0  # the mean: no better
    same = torch.full_like(returns, 0.1) + torch.tensor([[0.0, 1e-9, 0.0, 0.0]])  # only rounding varies
    assert math.isnan(explained_variance(torch.zeros_like(returns), same, mask))


def test_gae_needs_a_critic_and_a_critic_needs_gae(tiny_model_dir: Path) -> None:
    base = {"actor_rollout_ref": {"rollout": {"n": 2}}}
    assert TrainerConfig.from_dict({**base, "algorithm": {"adv_estimator": "gae"}}).uses_critic
    assert not TrainerConfig.from_dict(base).uses_critic
    with pytest.raises(Exception, match=r"critic\.enable"):
        TrainerConfig.from_dict({**base, "algorithm": {"adv_estimator": "gae"}, "critic": {"enable": False}})
    with pytest.raises(Exception, match="does not use a value model"):
        TrainerConfig.from_dict({**base, "critic": {"enable": True}})


def _ppo_config(model_dir: Path, **trainer: object) -> TrainerConfig:
    cfg = actor_config(model_dir).model_dump()
    cfg["algorithm"]["adv_estimator"] = "gae"
    cfg["critic"]["optim"]["lr"] = 1e-2
    cfg["critic"]["optim"]["weight_decay"] = 0.0
    cfg["trainer"].update(trainer)
    return TrainerConfig.model_validate(cfg)


def _ppo_batch() -> tuple[list[Triplet], object]:
    triplets = []
    for g in range(2):  # two tasks x two attempts, two calls each; rewards 0 / 1
        for k in range(2):
            triplets += _attempt_triplets(f"ro-{g}", f"at-{g}{k}", reward=float(k), task=g, answer=k)
    batch, _ = build_batch(triplets, max_prompt_length=32, max_response_length=16)
    return triplets, batch


def _attempt_triplets(rollout: str, attempt: str, reward: float, task: int, answer: int) -> list[Triplet]:
    """Two calls; the attempt whose first token is 31 (answer 1) gets reward 1, the one with 30 gets 0."""
    c1 = LLMCall(
        prompt_ids=[1, 5 + task, 9], response_ids=[30 + answer, 21, 22], response_logprobs=[-1.0] * 3
    )
    c2 = LLMCall(
        prompt_ids=[1, 5 + task, 9, 30 + answer, 21, 22, 40],
        response_ids=[23, 24],
        response_logprobs=[-1.0] * 2,
    )
    spans = [
        Span(rollout_id=rollout, attempt_id=attempt, sequence_id=1, payload=c1),
        Span(rollout_id=rollout, attempt_id=attempt, sequence_id=2, payload=c2),
        Span(rollout_id=rollout, attempt_id=attempt, sequence_id=3, payload=Reward(value=reward)),
    ]
    out = spans_to_triplets(spans, strategy="per_call").triplets
    for t in out:
        t.metadata["group_id"] = task
    return out


def test_the_critic_learns_the_returns_and_warmup_holds_the_policy(tiny_model_dir: Path) -> None:
    actor = Actor(_ppo_config(tiny_model_dir, critic_warmup=6), tiny_model_dir, "cpu")
    assert actor.critic is not None
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    losses = []
    for _ in range(6):
        _, batch = _ppo_batch()
        metrics = actor.update(batch)  # type: ignore[arg-type]
        losses.append(metrics["critic/vf_loss"])
        assert metrics["actor/critic_warmup"] == 1.0
    # the returns are 0 / 1. A value is the state's before its token: the first token's cannot know the
    # answer (1 token in 5: a floor of 0.5 * 0.25 / 5 = 0.025), the later ones can. A constant value stops
    # at 0.5 * 0.25 = 0.125 (the starting loss is 0.5 * mean(G^2) = 0.25): the critic must tell them apart
    assert losses[0] == pytest.approx(0.25) and losses[-1] < 0.1, losses
    for k, v in actor.model.state_dict().items():  # the policy waited for the critic
        torch.testing.assert_close(v, before[k])
    _, batch = _ppo_batch()
    metrics = actor.update(batch)  # type: ignore[arg-type]
    assert metrics["actor/critic_warmup"] == 0.0 and metrics["actor/optimizer_steps"] >= 1
    assert any(not torch.equal(v, before[k]) for k, v in actor.model.state_dict().items())
    for key in ("critic/vf_explained_var", "critic/vf_clipfrac", "critic/values_mean", "critic/returns_mean"):
        assert key in metrics


def test_a_resumed_critic_gives_the_same_next_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _ppo_config(tiny_model_dir)
    torch.manual_seed(0)
    first = TrainerWorker(cfg, str(tiny_model_dir), "cpu")
    first.update(_ppo_batch()[1])
    first.save_checkpoint(str(tmp_path))
    assert (tmp_path / "critic" / "model.safetensors").exists()
    going_on = first.update(_ppo_batch()[1])
    resumed = TrainerWorker(cfg, str(tiny_model_dir), "cpu")  # a fresh process after a kill
    assert resumed.load_checkpoint(str(tmp_path)) == 1 and resumed.actor.critic is not None
    assert resumed.actor.critic.step == 1
    again = resumed.update(_ppo_batch()[1])
    for key in ("critic/vf_loss", "critic/values_mean", "critic/vf_explained_var", "actor/pg_loss"):
        assert again[key] == pytest.approx(going_on[key], rel=1e-5, abs=1e-7), key


def test_a_batch_without_reward_signal_is_not_blown_up_to_unit_advantages() -> None:
    """Every attempt failed (returns 0): the advantages are only the critic's spread of values. Plain
    whitening divides them by that small std and trains on noise at full strength (|A| ~ 0.8 in the tools
    demo); with the std floor (0.1 reward units) they stay a tenth as large as the values' spread."""
    triplets, _ = _attempt(merge=False)
    for t in triplets:
        t.metadata["call_reward"] = 0.0
    batch, _ = build_batch(triplets, max_prompt_length=16, max_response_length=16)
    values = torch.zeros(batch.response_mask.shape)
    values[batch.response_mask.bool()] = torch.tensor([0.04, 0.06, 0.05])  # spread 0.01
    adv, _ = attempt_gae(batch, values, _config())
    m = batch.response_mask.bool()
    # centred -V: 0.01, -0.01, 0 -> divided by the floor 0.1 (their std is 0.01): 0.1, -0.1, 0
    torch.testing.assert_close(adv[m], torch.tensor([0.1, -0.1, 0.0]))
    floorless = TrainerConfig.from_dict(
        {
            "algorithm": {"adv_estimator": "gae", "gae_std_floor": 0.0},
            "actor_rollout_ref": {"rollout": {"n": 1}},
        }
    )
    assert float(attempt_gae(batch, values, floorless)[0][m].abs().max()) == pytest.approx(1.0, rel=1e-3)
