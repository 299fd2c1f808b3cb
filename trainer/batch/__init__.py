"""Triplets -> padded tensors: left-padded prompts, right-padded responses, masks and groups.

Layout of one row of ``input_ids`` (P = longest prompt, R = longest response of the batch)::

    [pad pad p0 p1 p2 | r0 r1 r2 pad pad]
     <---- P ------->   <----- R ----->

so every response starts at column P and the logits at columns P-1 .. P+R-2 score r0 .. r_{R-1}.
The trainer never re-tokenizes: the ids are the ones the engine saw and produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
import torch

from agentloop.adapter import group_by_attempt
from agentloop.errors import EmptyBatchError
from agentloop.types import Triplet
from trainer.batch._rows import (
    Row,
    Span,
    attempt_rows,
    call_positions,
    group_key,
    triplet_reward,
    unusable,
)
from trainer.batch._serialization import reduce_fields

log = structlog.get_logger(__name__)


@dataclass
class Calls:
    """The LLM calls behind a batch's rows, one entry per call (C calls).

    Call c's response tokens sit in row ``row[c]`` at response columns ``start[c] .. start[c] +
    length[c] - 1`` (a merged trajectory holds several calls in one row; tool tokens between them
    belong to no call). Advantages are computed per call, each attempt voting once, and scattered
    back into the rows: merging the turns of an attempt never changes what its tokens learn.
    """

    row: torch.Tensor  # (C,) long
    start: torch.Tensor  # (C,) long
    length: torch.Tensor  # (C,) long, after truncation (0 when truncation cut the call away)
    reward: torch.Tensor  # (C,) float32, the call's return from the adapter's credit assignment
    step_reward: torch.Tensor  # (C,) float32, the call's own reward (GAE's per-turn reward)
    group: torch.Tensor  # (C,) long, the task group (the attempts at one task in one step)
    attempt: torch.Tensor  # (C,) long, the attempt the call belongs to (numbered within the batch)
    position: torch.Tensor  # (C,) long, the call's place in its attempt (the adapter's call_index)
    source: torch.Tensor  # (C,) long, the index of the call's triplet in build_batch's input

    def __len__(self) -> int:
        return int(self.row.shape[0])

    __reduce_ex__ = (
        reduce_fields  # across processes, tensors as NumPy arrays (trainer/batch/_serialization.py)
    )

    def to(self, device: torch.device | str) -> Calls:
        return Calls(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})

    def positions(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices (C, L) into a (B, width) tensor for each call's tokens, and their validity (C, L)."""
        longest = int(self.length.max()) if len(self) else 0  # note: CPU-GPU sync on a GPU batch
        offsets = torch.arange(max(longest, 1), device=self.row.device)  # (L,)
        valid = offsets[None, :] < self.length[:, None]  # (C, L)
        flat = self.row[:, None] * width + self.start[:, None] + offsets[None, :]
        return torch.where(valid, flat, 0), valid

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each call's slice of the row tensor ``x`` (B, R) as (C, L), 0 past the call; and validity (C, L)."""
        flat, valid = self.positions(x.shape[1])
        return x.reshape(-1)[flat].masked_fill(~valid, 0), valid

    def scatter(self, y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The inverse of gather: (C, L) per-call values into a (B, R) tensor of ``shape``, 0 elsewhere."""
        flat, valid = self.positions(shape[1])
        out = torch.zeros(shape[0] * shape[1], dtype=y.dtype, device=y.device)
        out[flat[valid]] = y[:, : flat.shape[1]][valid]
        return out.view(shape)


@dataclass(frozen=True)
class HostRows:
    """What splitting a batch reads of each row, kept on the host so that splitting a GPU batch into
    mini- and micro-batches (and dealing it to ranks) never waits for the GPU."""

    prompt_tokens: tuple[int, ...]  # real prompt tokens of each row
    response_tokens: tuple[int, ...]  # real response tokens (tool tokens included) of each row
    group_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]  # rows with the same prompt tokens share an id: 0, 1, ... as they come

    @classmethod
    def of(cls, batch: Batch) -> HostRows:
        """Read from ``batch``'s tensors (a CPU-GPU sync when they are on a GPU)."""
        p = batch.prompt_length
        prompt_tokens = batch.attention_mask[:, :p].sum(-1).tolist()
        ids = batch.input_ids[:, :p].tolist()
        return cls(
            tuple(prompt_tokens),
            tuple(batch.attention_mask[:, p:].sum(-1).tolist()),
            tuple(batch.group_ids.tolist()),
            prompt_numbers([tuple(row[p - n :]) for row, n in zip(ids, prompt_tokens, strict=True)]),
        )

    def take(self, rows: Sequence[int]) -> HostRows:
        return HostRows(
            tuple(self.prompt_tokens[i] for i in rows),
            tuple(self.response_tokens[i] for i in rows),
            tuple(self.group_ids[i] for i in rows),
            prompt_numbers([(self.prompt_ids[i],) for i in rows]),  # numbered again: 0, 1, ... as they come
        )

    def sequence_tokens(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_tokens, self.response_tokens, strict=True)]


def prompt_numbers(prompts: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """An id per prompt, the same for equal prompts: distinct prompts numbered in order of appearance."""
    numbers: dict[tuple[int, ...], int] = {}
    return tuple(numbers.setdefault(prompt, len(numbers)) for prompt in prompts)


@dataclass
class Batch:
    """A padded training batch; row i of every tensor is sample i."""

    input_ids: torch.Tensor  # (B, P+R) long
    attention_mask: torch.Tensor  # (B, P+R) long, 1 on real tokens (tool tokens included)
    position_ids: torch.Tensor  # (B, P+R) long, 0, 1, ... over real tokens, 0 on padding
    response_mask: torch.Tensor  # (B, R) long, 1 where the model produced the token; 0 on pad and tool tokens
    rewards: torch.Tensor  # (B,) float32, the row's last call's reward (metrics; advantages use ``calls``)
    group_ids: torch.Tensor  # (B,) long, samples of the same rollout input share an id
    prompt_length: int  # P: responses start at this column
    engine_logprobs: torch.Tensor | None = None  # (B, R) float32, the engine's logprobs; 0 where masked
    metadata: list[dict[str, Any]] = field(default_factory=list)
    # tensors the trainer adds later (old/ref logprobs, advantages): (B, R) response-aligned or (B,)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    attempt_ids: torch.Tensor | None = None  # (B,) long, the attempt of each row; None: each row its own
    temperatures: torch.Tensor | None = None  # (B, R) float32, the sampling temperature of each token
    truncated: torch.Tensor | None = None  # (B,) bool, cut to max_response_length or stopped by max_tokens
    calls: Calls | None = None  # only on the batch build_batch made (advantages are computed on it)
    host_rows: HostRows | None = None  # the rows' lengths and groups on the host; see ``rows_on_host``

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    __reduce_ex__ = (
        reduce_fields  # across processes, tensors as NumPy arrays (trainer/batch/_serialization.py)
    )

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])  # R

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]  # (B, R)

    def sequence_lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(-1)  # (B,) non-pad tokens per sample

    def rows_on_host(self) -> HostRows:
        """The rows' token counts and groups as Python ints: kept from build_batch through ``select``
        and ``to``, read from the tensors (a CPU-GPU sync on a GPU batch) where a batch lacks them or
        they cannot be this batch's. Code that changes ``attention_mask`` or ``group_ids`` (not
        ``select``) must set ``host_rows=None``."""
        host = self.host_rows
        if (
            host is None
            or len(host.group_ids) != len(self)
            or max(host.prompt_tokens, default=0) > self.prompt_length
            or max(host.response_tokens, default=0) > self.response_length
        ):
            host = self.host_rows = HostRows.of(self)
        return host

    def fully_real(self) -> bool:
        """Whether no token of the batch is padding (every row fills both the prompt and the response
        columns), read on the host."""
        if self.input_ids.shape[1] != self.prompt_length + self.response_length:  # columns appended
            return False
        return self.prompts_unpadded() and all(
            r == self.response_length for r in self.rows_on_host().response_tokens
        )

    def prompts_unpadded(self) -> bool:
        """Whether every row fills the prompt columns (no left padding), read on the host."""
        return all(p == self.prompt_length for p in self.rows_on_host().prompt_tokens)

    def row_attempts(self) -> torch.Tensor:
        """(B,) attempt id of each row (each row its own attempt when the batch does not say)."""
        if self.attempt_ids is not None:
            return self.attempt_ids
        return torch.arange(len(self), device=self.input_ids.device)

    def logit_temperatures(self) -> torch.Tensor:
        """(B, R) what each token's logits are divided by: its sampling temperature, 1 for greedy (T=0)."""
        if self.temperatures is None:
            return torch.ones(self.response_mask.shape, dtype=torch.float32, device=self.input_ids.device)
        # the engines' floor: 0 < T < 1e-5 samples (and reports log-probs) as T = 1e-5
        return torch.where(self.temperatures > 0, self.temperatures.clamp(min=1e-5), 1.0)

    def to(self, device: torch.device | str) -> Batch:
        def move(t: torch.Tensor | None) -> Any:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(
            self,
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            response_mask=move(self.response_mask),
            rewards=move(self.rewards),
            group_ids=move(self.group_ids),
            engine_logprobs=move(self.engine_logprobs),
            extras={k: move(v) for k, v in self.extras.items()},
            attempt_ids=move(self.attempt_ids),
            temperatures=move(self.temperatures),
            truncated=move(self.truncated),
            calls=None if self.calls is None else self.calls.to(device),
        )

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """Rows ``indices`` (in that order), with the columns that are padding in all of them cut off.

        The selection has no ``calls``: advantages are computed on the whole batch before it is split."""
        # note: indices given as a GPU tensor are read back (a CPU-GPU sync); a list or a CPU tensor is not
        rows = indices.tolist() if isinstance(indices, torch.Tensor) else [int(i) for i in indices]
        host = self.rows_on_host().take(rows)
        idx = index_on(self.input_ids.device, rows)  # (b,)
        p = self.prompt_length
        new_p, new_r = max(host.prompt_tokens, default=0), max(host.response_tokens, default=0)
        cols = torch.arange(p - new_p, p + new_r, device=idx.device)  # kept columns

        def rows_cols(t: torch.Tensor) -> torch.Tensor:
            return t[idx][:, cols]

        def resp(t: torch.Tensor | None) -> Any:
            if t is None:
                return None
            return t[idx][:, :new_r] if t.dim() >= 2 else t[idx]

        return Batch(
            input_ids=rows_cols(self.input_ids),
            attention_mask=rows_cols(self.attention_mask),
            position_ids=rows_cols(self.position_ids),
            response_mask=resp(self.response_mask),
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            prompt_length=new_p,
            engine_logprobs=resp(self.engine_logprobs),
            metadata=[self.metadata[i] for i in rows] if self.metadata else [],
            extras={k: resp(v) for k, v in self.extras.items()},
            attempt_ids=resp(self.attempt_ids),
            temperatures=resp(self.temperatures),
            truncated=resp(self.truncated),
            host_rows=host,
        )


def index_on(device: torch.device, rows: Sequence[int]) -> torch.Tensor:
    """``rows`` as a long tensor on ``device``; copied to a GPU from pinned memory, without waiting
    for the work queued on it."""
    index = torch.tensor(rows, dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


@dataclass
class _Selection:
    """What ``build_batch`` keeps of its triplets, before padding."""

    rows: list[tuple[int, Row]]  # (attempt number, row), in the order of the batch
    voters: list[tuple[int, Span]]  # calls not trained (prompt too long) that keep their place in the vote
    group_keys: list[str]  # attempt number -> its group's key
    positions: dict[int, int]  # triplet index -> the call's place in its attempt
    stats: dict[str, int]  # what was kept and dropped (build_batch's second return)


def _row_budget(max_prompt_length: int, max_response_length: int, max_row_tokens: int | None) -> int:
    """The most tokens a row may hold (``max_row_tokens``, default prompt + response limits), checked."""
    if max_prompt_length < 1 or max_response_length < 1:
        raise ValueError(
            f"max_prompt_length and max_response_length must be >= 1, got {max_prompt_length}, "
            f"{max_response_length}"
        )
    budget = max_prompt_length + max_response_length if max_row_tokens is None else max_row_tokens
    if budget < max_prompt_length + max_response_length:
        raise ValueError(
            f"max_row_tokens ({budget}) must be at least max_prompt_length + max_response_length "
            f"({max_prompt_length + max_response_length}): one call must fit a row"
        )
    return budget


def _select(
    triplets: Sequence[Triplet], max_prompt_length: int, merge: bool, default_temperature: float, budget: int
) -> _Selection:
    """The attempts that can vote, their rows (merged when ``merge``), the calls whose prompt is too long."""
    stats = {
        "num_triplets": len(triplets),
        "num_samples": 0,
        "num_attempts": 0,
        "calls_prompt_too_long": 0,
        "attempts_untrained_prompt_too_long": 0,
        "dropped_attempts_empty": 0,
        "dropped_attempts_no_reward": 0,
        "dropped_attempts_nonfinite_reward": 0,
        "dropped_calls": 0,
        "truncated_samples": 0,
        "no_trainable_tokens": 0,
        "ungrouped": 0,
    }
    for t in triplets:
        if not isinstance(t, Triplet):
            raise TypeError(f"build_batch takes agentloop.types.Triplet objects, got {type(t).__name__}")
    selected = _Selection(rows=[], voters=[], group_keys=[], positions={}, stats=stats)
    attempts = 0
    for members in group_by_attempt(triplets):
        reasons = [r for i in members if (r := unusable(triplets[i])) is not None]
        if reasons:
            stats[reasons[0]] += 1
            stats["dropped_calls"] += len(members)
            continue
        number, attempts = attempts, attempts + 1
        selected.positions.update(call_positions(triplets, members))
        key = group_key(triplets[members[0]].metadata)
        if key is None:
            stats["ungrouped"] += 1
            key = f"attempt:{number}"
        selected.group_keys.append(key)
        trained = 0
        for row in attempt_rows(triplets, members, merge, default_temperature, budget if merge else None):
            if len(row.sample.prompt_ids) > max_prompt_length:
                stats["calls_prompt_too_long"] += len(row.spans)
                selected.voters.extend((number, span) for span in row.spans)
            else:
                selected.rows.append((number, row))
                trained += 1
        stats["attempts_untrained_prompt_too_long"] += int(trained == 0)
    stats["num_samples"], stats["num_attempts"] = len(selected.rows), attempts
    return selected


def _report_dropped(
    stats: dict[str, int], num_rows: int, max_prompt_length: int, require_nonempty: bool
) -> None:
    """Warn about what was dropped or not trained; raise EmptyBatchError when asked and nothing is left."""
    dropped = {k: v for k, v in stats.items() if k.startswith("dropped") and v}
    if dropped:
        log.warning("batch.dropped_attempts", **dropped)
    if stats["calls_prompt_too_long"]:
        log.warning(
            "batch.calls_prompt_too_long",
            calls=stats["calls_prompt_too_long"],
            attempts_untrained=stats["attempts_untrained_prompt_too_long"],
            max_prompt_length=max_prompt_length,
        )
    if not num_rows and require_nonempty:
        raise EmptyBatchError(
            f"no usable training sample out of {stats['num_triplets']} triplets "
            f"(dropped: {', '.join(f'{k}={v}' for k, v in dropped.items()) or 'none'}); "
            "did the agent call the LLM and give a reward? is max_prompt_length large enough?"
        )


class _CallColumns:
    """The columns of ``Calls``, one entry a call, appended row by row."""

    def __init__(self, positions: dict[int, int]) -> None:
        self.positions = positions  # triplet index -> the call's place in its attempt
        self.cols: dict[str, list[float]] = {
            k: [] for k in ("row", "start", "length", "reward", "step", "source", "position")
        }
        self.attempts: list[int] = []

    def add(self, row: int, start: int, length: int, span: Span, attempt: int) -> None:
        for k, v in (("row", row), ("start", start), ("length", length), ("reward", span.reward)):
            self.cols[k].append(v)
        self.cols["step"].append(span.step_reward)
        self.cols["source"].append(span.source)
        self.cols["position"].append(self.positions[span.source])
        self.attempts.append(attempt)

    def calls(self, group_of_attempt: Sequence[int]) -> Calls:
        longs = {
            k: torch.tensor(self.cols[k], dtype=torch.long)
            for k in ("row", "start", "length", "source", "position")
        }
        return Calls(
            row=longs["row"],
            start=longs["start"],
            length=longs["length"],
            reward=torch.tensor(self.cols["reward"], dtype=torch.float32),
            step_reward=torch.tensor(self.cols["step"], dtype=torch.float32),
            group=torch.tensor([group_of_attempt[a] for a in self.attempts], dtype=torch.long),
            attempt=torch.tensor(self.attempts, dtype=torch.long),  # (C,)
            position=longs["position"],
            source=longs["source"],
        )


@dataclass
class _Padded:
    """A batch's token tensors while its rows are written in (P = longest prompt, R = longest response)."""

    input_ids: torch.Tensor  # (B, P+R) long
    attention_mask: torch.Tensor  # (B, P+R) long
    response_mask: torch.Tensor  # (B, R) long
    temperatures: torch.Tensor  # (B, R) float32
    truncated: torch.Tensor  # (B,) bool
    logprobs: torch.Tensor | None  # (B, R) float32, only when every row has the engine's log-probs
    prompt_tokens: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, b: int, p: int, r_len: int, pad_token_id: int, with_logprobs: bool) -> _Padded:
        return cls(
            input_ids=torch.full((b, p + r_len), pad_token_id, dtype=torch.long),
            attention_mask=torch.zeros((b, p + r_len), dtype=torch.long),
            response_mask=torch.zeros((b, r_len), dtype=torch.long),
            temperatures=torch.ones((b, r_len), dtype=torch.float32),
            truncated=torch.zeros(b, dtype=torch.bool),
            logprobs=torch.zeros((b, r_len), dtype=torch.float32) if with_logprobs else None,
        )

    def write(self, i: int, row: Row, p: int, limit: int) -> int:
        """Write ``row`` into row ``i`` (its response cut at ``limit``); returns its response length."""
        sample = row.sample
        resp = sample.response_ids
        np_, nr = len(sample.prompt_ids), min(len(resp), limit)
        self.prompt_tokens.append(np_)
        self.response_tokens.append(nr)
        self.truncated[i] = len(resp) > limit or row.hit_max_tokens
        self.input_ids[i, p - np_ : p] = torch.tensor(sample.prompt_ids)
        self.input_ids[i, p : p + nr] = torch.tensor(resp[:nr])
        self.attention_mask[i, p - np_ : p + nr] = 1
        row_mask = sample.response_mask if sample.response_mask is not None else [1] * len(resp)
        mask = torch.tensor(row_mask[:nr], dtype=torch.long)  # (nr,)
        self.response_mask[i, :nr] = mask
        self.temperatures[i, :nr] = torch.tensor(row.temps[:nr])
        if self.logprobs is not None:  # 0 where masked
            lp = torch.tensor(sample.response_logprobs[:nr], dtype=torch.float32)  # type: ignore[index]  # (nr,)
            self.logprobs[i, :nr] = lp.masked_fill(mask == 0, 0.0)
        return nr


def build_batch(
    triplets: Sequence[Triplet],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int = 0,
    require_nonempty: bool = False,
    merge: bool = False,
    default_temperature: float = 1.0,
    max_row_tokens: int | None = None,
) -> tuple[Batch, dict[str, int]]:
    """Pad triplets (one per LLM call) into a Batch; returns it with counts of what was kept and dropped.

    Calls belong to attempts (``agentloop.adapter.group_by_attempt``: ``metadata["attempt_id"]``, else
    ``rollout_id``, else each call alone) and attempts to groups (``metadata["group_id"]``, else ``metadata["input"]``, else the attempt alone).
    No attempt leaves for being long: a call whose prompt is over ``max_prompt_length`` (the grown
    conversation of a long attempt) is not trained, but it keeps its place in its attempt's vote and the
    attempt's other calls train (counted: ``calls_prompt_too_long``, and
    ``attempts_untrained_prompt_too_long`` when none of an attempt's calls fit). An attempt that cannot
    vote (empty ids, no reward) leaves whole and is counted. A call's response over
    ``max_response_length`` is truncated to it, kept and flagged (``truncated``, like a call the engine
    stopped at max_tokens). ``merge=True`` merges the consecutive calls of an attempt whose prompt extends
    the previous call's prompt + response into one row of at most ``max_row_tokens`` tokens (default
    ``max_prompt_length + max_response_length``; ``agentloop.adapter.merge_turns``: tool tokens between
    them get mask 0); a call that would take a row over it starts the next row from its own prompt.
    Each token records its call's sampling temperature (``metadata["temperature"]``, else
    ``default_temperature``). Raises EmptyBatchError only when ``require_nonempty`` and nothing is left.
    """
    budget = _row_budget(max_prompt_length, max_response_length, max_row_tokens)
    selected = _select(triplets, max_prompt_length, merge, default_temperature, budget)
    rows, stats = selected.rows, selected.stats
    _report_dropped(stats, len(rows), max_prompt_length, require_nonempty)

    b = len(rows)
    p = max((len(r.sample.prompt_ids) for _, r in rows), default=0)  # P
    # a row of one call is cut at max_response_length; a merged row fits the budget by construction
    limits = [
        max_response_length if len(r.spans) == 1 else budget - len(r.sample.prompt_ids) for _, r in rows
    ]
    r_len = max(
        (min(len(r.sample.response_ids), n) for (_, r), n in zip(rows, limits, strict=True)), default=0
    )
    with_logprobs = b > 0 and all(r.sample.response_logprobs is not None for _, r in rows)
    padded = _Padded.empty(b, p, r_len, pad_token_id, with_logprobs)
    group_numbers = {k: n for n, k in enumerate(dict.fromkeys(selected.group_keys))}
    group_of_attempt = [group_numbers[k] for k in selected.group_keys]
    group_ids = torch.tensor([group_of_attempt[a] for a, _ in rows], dtype=torch.long)  # (B,)
    attempt_ids = torch.tensor([a for a, _ in rows], dtype=torch.long)  # (B,)
    columns = _CallColumns(selected.positions)
    for i, (attempt, row) in enumerate(rows):
        nr = padded.write(i, row, p, limits[i])
        stats["no_trainable_tokens"] += int(not bool(padded.response_mask[i, :nr].any()))
        for span in row.spans:
            columns.add(
                i, min(span.start, nr), max(0, min(span.start + span.length, nr) - span.start), span, attempt
            )
    for attempt, span in (
        selected.voters if b else []
    ):  # no tokens (length 0) but a place in the attempt's vote
        columns.add(0, 0, 0, span, attempt)
    stats["truncated_samples"] = int(padded.truncated.sum())
    position_ids = (padded.attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+R)
    rewards = torch.tensor([triplet_reward(r.sample) for _, r in rows], dtype=torch.float32)  # (B,)
    batch = Batch(
        input_ids=padded.input_ids,
        attention_mask=padded.attention_mask,
        position_ids=position_ids,
        response_mask=padded.response_mask,
        rewards=rewards,
        group_ids=group_ids,
        prompt_length=p,
        engine_logprobs=padded.logprobs,
        metadata=[r.metadata for _, r in rows],
        attempt_ids=attempt_ids,
        temperatures=padded.temperatures,
        truncated=padded.truncated,
        calls=columns.calls(group_of_attempt),
        host_rows=HostRows(
            tuple(padded.prompt_tokens),
            tuple(padded.response_tokens),
            tuple(group_ids.tolist()),
            prompt_numbers([tuple(r.sample.prompt_ids) for _, r in rows]),
        ),
    )
    return batch, stats
