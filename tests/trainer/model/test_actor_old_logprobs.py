"""Where an update's old log-probs come from: a pass of their own, or on-policy (one epoch of one
mini-batch) the loss's own forward, detached, as verl does; the same step up to float rounding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.samples import actor_config, small_batch, small_triplets
from tests.trainer.tolerances import EPS32, assert_one_adam_step_agrees, gradient_noise
from trainer.batch import Batch, build_batch
from trainer.model.actor import Actor

VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)


def _updated(model_dir: Path, batch: Batch, **actor: Any) -> tuple[Actor, dict[str, float], int]:
    """An actor on ``model_dir`` after one update on ``batch``, its metrics, and its old-logprob passes."""
    overrides = actor.pop("overrides", [])
    config = actor_config(model_dir, **actor).with_overrides(overrides)
    torch.manual_seed(0)
    trained = Actor(config, model_dir, "cpu")
    passes = 0
    compute = trained.compute_logprobs

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal passes
        passes += 1
        return compute(*args, **kwargs)

    trained.compute_logprobs = counted  # type: ignore[method-assign]
    metrics = trained.update(batch)
    return trained, metrics, passes


@dataclass
class _Start:
    """Where ``_updated`` starts from, and how far apart two ways of taking its step may land."""

    weights: dict[str, torch.Tensor]
    ratio_error: float  # |exp(log p - old) - 1| when the old log-probs come from another pass
    noise: float  # the two ways' clipped gradients apart (clip norm 1)


def _start(model_dir: Path, batch: Batch) -> _Start:
    """Both ways' log-probs are float32 logit - logsumexp over V logits, each off by up to
    eps * (2M + log2 V), M = max |log p| + log2 V (as in test_actor), so their ratio is 1 within twice
    that; every token's gradient term is scaled by it, and the sums run in other orders (gradient_noise)."""
    torch.manual_seed(0)  # as _updated
    actor = Actor(actor_config(model_dir), model_dir, "cpu")
    with torch.no_grad():
        logprobs = actor.compute_logprobs(batch)[batch.response_mask.bool()]
    log2_v = VOCAB.bit_length()
    ratio_error = 2 * EPS32 * (2 * (float(logprobs.abs().max()) + log2_v) + log2_v)
    noise = gradient_noise(int(batch.attention_mask.sum()), VOCAB) + ratio_error
    return _Start({k: v.detach().clone() for k, v in actor.model.named_parameters()}, ratio_error, noise)


def test_one_mini_batch_takes_its_old_logprobs_from_the_loss(tiny_model_dir: Path) -> None:
    batch = small_batch()  # 2 groups, ppo_mini_batch_size 2: one mini-batch
    fused, fused_metrics, fused_passes = _updated(tiny_model_dir, batch)
    plain, plain_metrics, plain_passes = _updated(tiny_model_dir, batch, on_policy_old_logprobs=False)
    assert (fused_passes, plain_passes) == (0, 1)
    assert fused_metrics["actor/old_logprobs_from_the_loss"] == 1.0
    assert plain_metrics["actor/old_logprobs_from_the_loss"] == 0.0
    assert fused_metrics["actor/approx_kl"] == 0.0 and fused_metrics["actor/clip_frac"] == 0.0  # ratio 1
    # the same terms with ratios 1 and 1 within ratio_error: pg_loss is a mean of |A| <= 1 terms summed in
    # other orders (n * eps) and scaled by the ratio
    start = _start(tiny_model_dir, batch)
    pg_atol = int(batch.response_mask.sum()) * EPS32 + start.ratio_error
    assert fused_metrics["actor/pg_loss"] == pytest.approx(plain_metrics["actor/pg_loss"], abs=pg_atol)
    # grad_norm is the norm before clipping: relative errors (the ratio's, the sums' order at scale 1)
    rel = start.ratio_error + gradient_noise(int(batch.attention_mask.sum()), VOCAB)
    assert fused_metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=rel)
    lr = fused.config.actor_rollout_ref.actor.optim.lr
    constrained = 0
    for (name, x), y in zip(fused.model.named_parameters(), plain.model.parameters(), strict=True):
        constrained += assert_one_adam_step_agrees(
            x.detach(), y.detach(), start.weights[name], lr=lr, noise=start.noise, what=name
        )
    assert constrained > 10_000  # weights whose gradient is clear of the noise: the comparison has teeth


def test_several_mini_batches_recompute_the_old_logprobs(tiny_model_dir: Path) -> None:
    """The second mini-batch runs after a step: its old log-probs must be the policy's before it."""
    batch = small_batch()
    on, on_metrics, on_passes = _updated(tiny_model_dir, batch, ppo_mini_batch_size=1)  # 2 mini-batches
    off, _, off_passes = _updated(tiny_model_dir, batch, ppo_mini_batch_size=1, on_policy_old_logprobs=False)
    assert (on_passes, off_passes) == (1, 1)
    assert on_metrics["actor/old_logprobs_from_the_loss"] == 0.0
    assert on_metrics["actor/optimizer_steps"] == 2.0
    for (name, x), y in zip(on.model.named_parameters(), off.model.parameters(), strict=True):
        assert torch.equal(x, y), name  # both ran the pass: the same computation
    _, _, epochs_passes = _updated(tiny_model_dir, batch, ppo_epochs=2)  # a second epoch: the same
    assert epochs_passes == 1


def _with_engine_logprobs(actor: Actor, shifts: list[float], rewards: list[float] | None = None) -> Batch:
    """small_batch (with ``rewards``) whose row i has engine log-probs ``shifts[i]`` above the policy's."""
    policy = actor.compute_logprobs(small_batch())
    triplets = [
        t.model_copy(
            update={
                "response_logprobs": (policy[i, : len(t.response_ids)] + shifts[i]).tolist(),
                "reward": t.reward if rewards is None else rewards[i],
            }
        )
        for i, t in enumerate(small_triplets())
    ]
    return build_batch(triplets, max_prompt_length=32, max_response_length=16)[0]


def test_the_loss_forward_reports_the_engine_gap_over_the_tokens_it_trains(tiny_model_dir: Path) -> None:
    """Group 1 (rows 2, 3) scored alike: no signal, not trained, so its gap goes unmeasured (only its
    entropy is, in a forward without autograd)."""
    torch.manual_seed(0)
    probe = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    shifts = [0.1, -0.2, 0.7, 0.9]
    batch = _with_engine_logprobs(probe, shifts, rewards=[0.0, 1.0, 1.0, 1.0])
    _, metrics, passes = _updated(tiny_model_dir, batch)
    assert passes == 0 and metrics["actor/active_samples"] == 2.0
    tokens = batch.response_mask.sum(-1).tolist()  # rows 0 and 1 trained
    mean = (0.1 * tokens[0] + 0.2 * tokens[1]) / (tokens[0] + tokens[1])
    # the loss's log-probs and the probe's are float32 logit - logsumexp over V logits, each off by up
    # to eps * (2M + log2 V) (M bounds |log p|, as in test_actor), and the shift rounds once more
    eps, log2_v = torch.finfo(torch.float32).eps, (49152).bit_length()
    mag = float(batch.engine_logprobs.abs().max()) + log2_v
    atol = 2 * eps * (2 * mag + log2_v) + eps * mag
    assert metrics["actor/engine_logprob_gap_mean"] == pytest.approx(mean, abs=atol)
    assert metrics["actor/engine_logprob_gap_max"] == pytest.approx(0.2, abs=atol)
    _, recomputed, _ = _updated(tiny_model_dir, batch, on_policy_old_logprobs=False)  # every row
    assert recomputed["actor/engine_logprob_gap_max"] == pytest.approx(0.9, abs=atol)


def test_no_row_trained_reports_no_gap(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    probe = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    batch = _with_engine_logprobs(probe, [0.5] * 4, rewards=[1.0] * 4)
    _, metrics, _ = _updated(tiny_model_dir, batch)
    assert metrics["actor/active_samples"] == 0.0
    assert "actor/engine_logprob_gap_mean" not in metrics and "actor/engine_logprob_gap_max" not in metrics


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.rollout_correction.rollout_is=token"],  # IS weights from old vs engine, before the loss
        ["actor_rollout_ref.rollout.max_staleness=1"],  # auto: token-level IS for batches that may lag
    ],
    ids=["rollout-is", "stale-batches"],
)
def test_rollout_correction_recomputes_the_old_logprobs(tiny_model_dir: Path, overrides: list[str]) -> None:
    torch.manual_seed(0)
    batch = _with_engine_logprobs(Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu"), [0.0] * 4)
    _, metrics, passes = _updated(tiny_model_dir, batch, overrides=overrides)
    assert passes == 1
    assert metrics["actor/old_logprobs_from_the_loss"] == 0.0
