"""Triplets -> padded tensors: left-padded prompts, right-padded responses, masks and groups.

Layout of one row of ``input_ids`` (P = longest prompt, R = longest response of the batch)::

    [pad pad p0 p1 p2 | r0 r1 r2 pad pad]
     <---- P ------->   <----- R ----->

so every response starts at column P and the logits at columns P-1 .. P+R-2 score r0 .. r_{R-1}.
The trainer never re-tokenizes: the ids are the ones the engine saw and produced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
import torch

from agentloop.errors import EmptyBatchError
from agentloop.types import Triplet

log = structlog.get_logger(__name__)


@dataclass
class Batch:
    """A padded training batch; row i of every tensor is sample i."""

    input_ids: torch.Tensor  # (B, P+R) long
    attention_mask: torch.Tensor  # (B, P+R) long, 1 on real tokens (tool tokens included)
    position_ids: torch.Tensor  # (B, P+R) long, 0, 1, ... over real tokens, 0 on padding
    response_mask: torch.Tensor  # (B, R) long, 1 where the model produced the token; 0 on pad and tool tokens
    rewards: torch.Tensor  # (B,) float32
    group_ids: torch.Tensor  # (B,) long, samples of the same rollout input share an id
    prompt_length: int  # P: responses start at this column
    engine_logprobs: torch.Tensor | None = None  # (B, R) float32, the engine's logprobs; 0 where masked
    metadata: list[dict[str, Any]] = field(default_factory=list)
    # tensors the trainer adds later (old/ref logprobs, advantages): (B, R) response-aligned or (B,)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])  # R

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]  # (B, R)

    def sequence_lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(-1)  # (B,) non-pad tokens per sample

    def to(self, device: torch.device | str) -> Batch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self,
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            response_mask=move(self.response_mask),
            rewards=move(self.rewards),
            group_ids=move(self.group_ids),
            engine_logprobs=None if self.engine_logprobs is None else move(self.engine_logprobs),
            extras={k: move(v) for k, v in self.extras.items()},
        )

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """Rows ``indices`` (in that order), with the columns that are padding in all of them cut off."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.input_ids.device)  # (b,)
        p, attn = self.prompt_length, self.attention_mask[idx]  # (b, P+R)
        # note: .item() here is a CPU-GPU sync point when the batch is on a GPU
        new_p = int(attn[:, :p].sum(-1).max().item()) if len(idx) else 0
        new_r = int(attn[:, p:].sum(-1).max().item()) if len(idx) else 0
        cols = torch.arange(p - new_p, p + new_r, device=idx.device)  # kept columns

        def rows_cols(t: torch.Tensor) -> torch.Tensor:
            return t[idx][:, cols]

        def resp(t: torch.Tensor) -> torch.Tensor:
            return t[idx][:, :new_r] if t.dim() >= 2 else t[idx]

        return Batch(
            input_ids=rows_cols(self.input_ids),
            attention_mask=rows_cols(self.attention_mask),
            position_ids=rows_cols(self.position_ids),
            response_mask=resp(self.response_mask),
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            prompt_length=new_p,
            engine_logprobs=None if self.engine_logprobs is None else resp(self.engine_logprobs),
            metadata=[self.metadata[i] for i in idx.tolist()],
            extras={k: resp(v) for k, v in self.extras.items()},
        )


def _group_key(metadata: dict[str, Any]) -> str | None:
    if metadata.get("group_id") is not None:
        return f"id:{metadata['group_id']}"
    if "input" in metadata:
        text = json.dumps(metadata["input"], sort_keys=True, default=str)
        return "input:" + hashlib.sha1(text.encode()).hexdigest()
    return None


def build_batch(
    triplets: Sequence[Triplet],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int = 0,
    require_nonempty: bool = False,
) -> tuple[Batch, dict[str, int]]:
    """Pad triplets into a Batch; returns it with counts of what was kept and dropped.

    Dropped (and counted, never raised): prompt > max_prompt_length, response > max_response_length,
    an empty prompt or response, no token to train on (mask all 0), no reward. Samples are grouped by
    ``metadata["group_id"]``, else by ``metadata["input"]``; a sample with neither is a group of its own.
    Raises EmptyBatchError only when ``require_nonempty`` and nothing is left.
    """
    if max_prompt_length < 1 or max_response_length < 1:
        raise ValueError(
            f"max_prompt_length and max_response_length must be >= 1, got {max_prompt_length}, "
            f"{max_response_length}"
        )
    stats = {
        "num_triplets": len(triplets),
        "num_samples": 0,
        "dropped_prompt_too_long": 0,
        "dropped_response_too_long": 0,
        "dropped_empty": 0,
        "dropped_no_trainable_tokens": 0,
        "dropped_no_reward": 0,
        "ungrouped": 0,
    }
    kept: list[Triplet] = []
    for t in triplets:
        if not isinstance(t, Triplet):
            raise TypeError(f"build_batch takes agentloop.types.Triplet objects, got {type(t).__name__}")
        if not t.prompt_ids or not t.response_ids:
            stats["dropped_empty"] += 1
        elif len(t.prompt_ids) > max_prompt_length:
            stats["dropped_prompt_too_long"] += 1
        elif len(t.response_ids) > max_response_length:
            stats["dropped_response_too_long"] += 1
        elif not any(t.response_mask or ()):
            stats["dropped_no_trainable_tokens"] += 1
        elif t.reward is None:
            stats["dropped_no_reward"] += 1
        else:
            kept.append(t)
    stats["num_samples"] = len(kept)
    dropped = stats["num_triplets"] - len(kept)
    if dropped:
        log.warning("batch.dropped_samples", **{k: v for k, v in stats.items() if v})
    if not kept and require_nonempty:
        raise EmptyBatchError(
            f"no usable training sample out of {len(triplets)} triplets "
            f"(dropped: {', '.join(f'{k}={v}' for k, v in stats.items() if k.startswith('dropped') and v) or 'none'}); "
            "did the agent call the LLM? are max_prompt_length / max_response_length large enough?"
        )

    b = len(kept)
    p = max((len(t.prompt_ids) for t in kept), default=0)  # P
    r = max((len(t.response_ids) for t in kept), default=0)  # R
    input_ids = torch.full((b, p + r), pad_token_id, dtype=torch.long)  # (B, P+R)
    attention_mask = torch.zeros((b, p + r), dtype=torch.long)  # (B, P+R)
    response_mask = torch.zeros((b, r), dtype=torch.long)  # (B, R)
    with_logprobs = b > 0 and all(t.response_logprobs is not None for t in kept)
    logprobs = torch.zeros((b, r), dtype=torch.float32) if with_logprobs else None  # (B, R)
    keys: dict[str, int] = {}
    group_ids = torch.zeros(b, dtype=torch.long)  # (B,)
    for i, t in enumerate(kept):
        np_, nr = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, p - np_ : p] = torch.tensor(t.prompt_ids)
        input_ids[i, p : p + nr] = torch.tensor(t.response_ids)
        attention_mask[i, p - np_ : p + nr] = 1
        mask = torch.tensor(t.response_mask, dtype=torch.long)  # (nr,)
        response_mask[i, :nr] = mask
        if logprobs is not None:
            logprobs[i, :nr] = torch.tensor(t.response_logprobs, dtype=torch.float32) * mask
        key = _group_key(t.metadata)
        if key is None:
            stats["ungrouped"] += 1
            key = f"sample:{i}"
        group_ids[i] = keys.setdefault(key, len(keys))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+R)
    rewards = torch.tensor([float(t.reward) for t in kept], dtype=torch.float32)  # type: ignore[arg-type]
    batch = Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rewards=rewards,
        group_ids=group_ids,
        prompt_length=p,
        engine_logprobs=logprobs,
        metadata=[dict(t.metadata) for t in kept],
    )
    return batch, stats


def merge_trajectory(triplets: Sequence[Triplet]) -> list[Triplet]:
    """Merge consecutive calls of one attempt into one sample where each prompt extends the last.

    When call k's prompt starts with the merged sample's prompt + response, the sample's response
    grows by the extra prompt tokens (tool results, chat template: mask 0, logprob 0) and then call k's
    response (its own mask and logprobs). A call that does not extend starts a new sample. The merged
    reward is the last call's non-None reward; metadata is the first call's updated by the last's.
    """
    out: list[Triplet] = []
    cur: dict[str, Any] | None = None

    def close(c: dict[str, Any]) -> None:
        meta = {**c["first_meta"], **c["last_meta"], "merged_calls": c["calls"]}
        out.append(
            Triplet(
                prompt_ids=c["prompt"],
                response_ids=c["resp"],
                response_logprobs=c["logp"],
                response_mask=c["mask"],
                reward=c["reward"],
                metadata=meta,
            )
        )

    for t in triplets:
        if not isinstance(t, Triplet):
            raise TypeError(f"merge_trajectory takes agentloop.types.Triplet objects, got {type(t).__name__}")
        mask = list(t.response_mask or [1] * len(t.response_ids))
        logp = None
        if t.response_logprobs is not None:
            logp = [lp if m else 0.0 for lp, m in zip(t.response_logprobs, mask, strict=True)]
        if cur is not None:
            full = cur["prompt"] + cur["resp"]
            if t.prompt_ids[: len(full)] == full:
                extra = t.prompt_ids[len(full) :]
                cur["resp"] = cur["resp"] + extra + list(t.response_ids)
                cur["mask"] = cur["mask"] + [0] * len(extra) + mask
                cur["logp"] = (
                    None if cur["logp"] is None or logp is None else cur["logp"] + [0.0] * len(extra) + logp
                )
                cur["reward"] = t.reward if t.reward is not None else cur["reward"]
                cur["last_meta"] = t.metadata
                cur["calls"] += 1
                continue
            close(cur)
        cur = {
            "prompt": list(t.prompt_ids),
            "resp": list(t.response_ids),
            "mask": mask,
            "logp": logp,
            "reward": t.reward,
            "first_meta": t.metadata,
            "last_meta": t.metadata,
            "calls": 1,
        }
    if cur is not None:
        close(cur)
    return out


def split_by_token_budget(batch: Batch, max_tokens: int, *, padded: bool = False) -> list[Batch]:
    """Micro-batches of whole samples whose token count stays <= max_tokens (a longer sample goes alone).

    Counts non-pad tokens by default (packed attention); ``padded=True`` counts rows x padded width,
    what a padded forward pass really computes. Samples are taken longest first, so each micro-batch
    holds similar lengths; the split is deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    p = batch.prompt_length
    # note: .tolist() is a CPU-GPU sync point when the batch is on a GPU
    plen = batch.attention_mask[:, :p].sum(-1).tolist()
    rlen = batch.attention_mask[:, p:].sum(-1).tolist()
    order = sorted(range(len(batch)), key=lambda i: -(plen[i] + rlen[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    total = max_p = max_r = 0  # of cur
    for i in order:
        mp, mr = max(max_p, plen[i]), max(max_r, rlen[i])
        cost = (len(cur) + 1) * (mp + mr) if padded else total + plen[i] + rlen[i]
        if cur and cost > max_tokens:
            groups.append(cur)
            cur, total, mp, mr = [], 0, plen[i], rlen[i]
        cur.append(i)
        total, max_p, max_r = total + plen[i] + rlen[i], mp, mr
    if cur:
        groups.append(cur)
    return [batch.select(g) for g in groups]


def split_mini_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive slices of ``size`` samples, in order (the last one may be smaller); no shuffling."""
    if size < 1:
        raise ValueError(f"mini-batch size must be >= 1, got {size}")
    return [batch.select(list(range(s, min(s + size, len(batch))))) for s in range(0, len(batch), size)]
