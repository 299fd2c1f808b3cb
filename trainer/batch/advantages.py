"""Advantages of a batch, computed per LLM call with each attempt voting once, and the public seam.

A batch row is a call, or several calls of one attempt merged (``adapter.trajectory``). Advantages
are computed on the calls (``Batch.calls``): each call's return (the adapter's credit assignment) is
placed on its last token, the registered estimator runs with ``index`` = the task group,
``attempt_index`` = the attempt and ``call_position`` = the call's place in it, so an attempt that
made five calls counts once in its group's statistics at each call position (``_adv_estimators``),
and a merged row's tokens get exactly what its calls would get unmerged. With ``use_kl_in_reward``
the group statistics are taken over the KL-penalised scores, as verl's. The per-call advantages are then scattered back into the rows.

``sample_advantages(triplets, config)`` runs the same code on triplets, without a model, so users
and tests can see what each sample will learn before training on it.

With a value model (``gae``) the unit is the attempt, not the call: ``attempt_gae`` lays each
attempt's calls end to end in call order (its model tokens only: tool results, later user turns and
other masked tokens carry no value and no TD error, they are skipped as verl's multi-turn GAE skips
observation tokens), places each call's own reward (``call_reward``) on the call's last token, and
runs GAE over that one sequence, so the value after one turn bootstraps the turn before it. A call
that truncation cut away hands its reward to the last token the attempt kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentloop.errors import ConfigError
from agentloop.types import Triplet
from trainer.algorithms import compute_advantage, gae, scores_to_token_rewards
from trainer.batch import Batch, build_batch
from trainer.config import TrainerConfig


def batch_advantages(batch: Batch, config: TrainerConfig, kl: torch.Tensor | None = None) -> torch.Tensor:
    """(B, R) advantages of ``batch`` (0 on masked tokens); ``kl`` (B, R): per-token KL subtracted
    from the rewards with ``algorithm.kl_ctrl.kl_coef`` (``use_kl_in_reward``)."""
    calls = batch.calls
    if calls is None:
        raise ValueError("advantages need the batch build_batch made (a selection has no calls)")
    mask = batch.response_mask  # (B, R)
    call_mask, valid = calls.gather(mask)  # (C, L)
    call_mask = call_mask.bool() & valid
    rewards = scores_to_token_rewards(calls.reward, call_mask)  # (C, L): the call's return on its last token
    if kl is not None:
        call_kl, _ = calls.gather(kl)
        rewards = rewards - config.algorithm.kl_ctrl.kl_coef * call_kl.masked_fill(~call_mask, 0.0)
    algo = config.algorithm
    out = compute_advantage(
        algo.adv_estimator,
        rewards,
        call_mask,
        index=calls.group,
        attempt_index=calls.attempt,
        call_position=calls.position,
        norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
        gamma=algo.gamma,
        lam=algo.lam,
    )
    return calls.scatter(out.advantages, tuple(mask.shape)) * mask  # type: ignore[arg-type]


def attempt_gae(
    batch: Batch, values: torch.Tensor, config: TrainerConfig, kl: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) advantages (whitened over the batch's tokens) and returns (the critic's targets) by GAE
    over each attempt's model tokens (module docstring); ``values`` (B, R) are the critic's, ``kl``
    (B, R) a per-token penalty subtracted from the rewards (``use_kl_in_reward``). 0 off the mask."""
    calls = batch.calls
    if calls is None:
        raise ValueError("GAE needs the batch build_batch made (a selection has no calls)")
    mask = batch.response_mask.bool()  # (B, R)
    shape = tuple(mask.shape)
    flat, valid = calls.positions(shape[1])  # (C, L)
    trainable = mask.reshape(-1)[flat] & valid  # (C, L): the call's tokens the mask keeps
    attempt, source = calls.attempt.tolist(), calls.source.tolist()  # note: CPU-GPU sync on a GPU batch
    streams: dict[int, list[torch.Tensor]] = {}
    ends: dict[int, list[tuple[int, float]]] = {}  # attempt -> (offset of a call's last token, reward)
    pending: dict[int, float] = {}  # rewards of calls with no token kept, for the next token kept
    lengths: dict[int, int] = {}
    for c in sorted(range(len(calls)), key=lambda c: (attempt[c], source[c])):
        a = attempt[c]
        idx = flat[c][trainable[c]]  # (n,)
        reward = pending.pop(a, 0.0) + float(calls.step_reward[c])
        if idx.numel() == 0:
            pending[a] = reward
            continue
        streams.setdefault(a, []).append(idx)
        lengths[a] = lengths.get(a, 0) + int(idx.numel())
        ends.setdefault(a, []).append((lengths[a] - 1, reward))
    for a, reward in pending.items():  # the attempt's last calls were cut away: its last kept token
        if a in ends:
            offset, before = ends[a][-1]
            ends[a][-1] = (offset, before + reward)
    order = list(streams)
    if not order:
        zeros = torch.zeros(shape, dtype=torch.float32, device=mask.device)
        return zeros, zeros.clone()
    width = max(lengths[a] for a in order)
    index = torch.zeros((len(order), width), dtype=torch.long, device=mask.device)  # (A, L) flat (B*R)
    tokens = torch.zeros((len(order), width), dtype=torch.bool, device=mask.device)  # (A, L)
    rewards = torch.zeros((len(order), width), dtype=torch.float32, device=mask.device)  # (A, L)
    for i, a in enumerate(order):
        joined = torch.cat(streams[a])
        index[i, : joined.numel()] = joined
        tokens[i, : joined.numel()] = True
        for offset, reward in ends[a]:
            rewards[i, offset] += reward
    if kl is not None:
        rewards = rewards - config.algorithm.kl_ctrl.kl_coef * kl.reshape(-1)[index].masked_fill(~tokens, 0.0)
    out = gae(
        rewards,
        tokens,
        values=values.reshape(-1)[index].float(),
        gamma=config.algorithm.gamma,
        lam=config.algorithm.lam,
        std_floor=config.algorithm.gae_std_floor,
    )
    advantages = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=mask.device)
    returns = torch.zeros_like(advantages)
    advantages[index[tokens]] = out.advantages[tokens]
    returns[index[tokens]] = out.returns[tokens]
    return advantages.view(shape), returns.view(shape)


def loss_mask(batch: Batch, config: TrainerConfig) -> torch.Tensor:
    """(B, R) bool: the tokens the loss trains on; with ``algorithm.overlong_filter`` the truncated
    samples' tokens are left out (they still count in their group's statistics)."""
    keep = batch.response_mask.bool()
    if config.algorithm.overlong_filter and batch.truncated is not None:
        keep = keep & ~batch.truncated[:, None]
    return keep


def sample_advantages(
    triplets: Sequence[Triplet], config: TrainerConfig | dict | None = None
) -> list[float | None]:
    """The mean advantage over each triplet's trained response tokens, in input order, exactly as the
    loss would see it (merging, truncation, attempt grouping, overlong filtering as configured).

    None for a triplet that gets no training signal: its attempt left the batch (no reward, empty ids),
    its prompt is over ``data.max_prompt_length`` (its attempt still votes), or none of its tokens is
    trained on. Rejection masks need the
    policy's log-probs and are not applied here; ``use_kl_in_reward`` needs the reference model's and
    is refused.
    """
    cfg = TrainerConfig.from_dict(config)
    if cfg.algorithm.use_kl_in_reward:
        raise ConfigError(
            "sample_advantages cannot apply algorithm.use_kl_in_reward: the KL penalty needs the policy's "
            "and the reference model's log-probs; set it to false to see the advantages without it"
        )
    if isinstance(triplets, str | bytes) or not isinstance(triplets, Sequence):
        raise TypeError(f"triplets must be a list of agentloop Triplet, got {type(triplets).__name__}")
    batch, _ = build_batch(
        list(triplets),
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
        merge=cfg.adapter.trajectory,
        max_row_tokens=cfg.data.row_tokens,
        default_temperature=cfg.actor_rollout_ref.rollout.temperature,
    )
    out: list[float | None] = [None] * len(triplets)
    if len(batch) == 0 or batch.calls is None:
        return out
    adv = batch_advantages(batch, cfg)  # (B, R)
    keep = loss_mask(batch, cfg)
    call_adv, valid = batch.calls.gather(adv)  # (C, L)
    call_keep = batch.calls.gather(keep.long())[0].bool() & valid  # (C, L)
    counts = call_keep.sum(-1)  # (C,)
    sums = (call_adv * call_keep).sum(-1)  # (C,)
    for c, source in enumerate(batch.calls.source.tolist()):
        if int(counts[c]) > 0:
            out[source] = float(sums[c] / counts[c])
    return out


__all__ = ["batch_advantages", "loss_mask", "sample_advantages"]
