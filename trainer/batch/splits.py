"""Splitting a padded batch: into mini-batches of whole task groups, into micro-batches under a token
budget. Both read the rows' lengths and groups on the host (``Batch.rows_on_host``), so splitting a
batch that lives on a GPU never waits for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.batch import Batch, HostRows


def split_by_token_budget(
    batch: Batch, max_tokens: int, *, padded: bool = False, shared_prompts: bool = False
) -> list[Batch]:
    """Micro-batches of whole samples whose token count stays <= max_tokens (a longer sample goes alone).

    Counts non-pad tokens by default (packed attention); ``padded=True`` counts rows x padded width,
    what a padded forward pass really computes. Samples are taken longest first, so each micro-batch
    holds similar lengths; the split is deterministic. ``shared_prompts=True`` (a forward that runs
    each distinct prompt once) counts each distinct prompt once and keeps the rows that share a prompt
    next to each other, longest prompt group first.
    """
    host = batch.rows_on_host()
    # prompt ids count up as the prompts first appear, so they order the prompts as their first rows do
    prompt_of = host.prompt_ids if shared_prompts else None
    return [batch.select(g) for g in token_budget_rows(host, max_tokens, padded=padded, prompt_of=prompt_of)]


def token_budget_rows(
    host: HostRows, max_tokens: int, *, padded: bool = False, prompt_of: Sequence[int] | None = None
) -> list[list[int]]:
    """The rows of each micro-batch ``split_by_token_budget`` makes, read from the rows' lengths alone;
    ``prompt_of`` (a prompt id per row) counts each distinct prompt once, as ``shared_prompts`` does."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    plen, rlen = host.prompt_tokens, host.response_tokens
    order = sorted(range(len(plen)), key=lambda i: -(plen[i] + rlen[i]))
    shared_prompts = prompt_of is not None
    if prompt_of is None:
        prompt_of = range(len(plen))  # a prompt id per row: every row its own without sharing
    else:
        longest: dict[int, int] = {}
        for i in order:
            longest.setdefault(prompt_of[i], plen[i] + rlen[i])  # order is longest first
        order.sort(key=lambda i: (-longest[prompt_of[i]], prompt_of[i]))  # stable: longest first within
    groups: list[list[int]] = []
    cur: list[int] = []
    prompts: set[int] = set()  # distinct prompts in cur
    total = max_p = max_r = 0  # of cur
    for i in order:
        mp, mr = max(max_p, plen[i]), max(max_r, rlen[i])
        new_prompt = prompt_of[i] not in prompts
        if shared_prompts:
            n_prompts = len(prompts) + new_prompt
            cost = n_prompts * mp + (len(cur) + 1) * mr if padded else total + plen[i] * new_prompt + rlen[i]
        else:
            cost = (len(cur) + 1) * (mp + mr) if padded else total + plen[i] + rlen[i]
        if cur and cost > max_tokens:
            groups.append(cur)
            cur, prompts, total, mp, mr, new_prompt = [], set(), 0, plen[i], rlen[i], True
        cur.append(i)
        prompts.add(prompt_of[i])
        total, max_p, max_r = total + plen[i] * (new_prompt or not shared_prompts) + rlen[i], mp, mr
    if cur:
        groups.append(cur)
    return groups


def split_by_groups(batch: Batch, groups_per_mini_batch: int) -> list[Batch]:
    """Mini-batches holding the rows of ``groups_per_mini_batch`` whole groups each (in order of first
    appearance): a task's attempts, however many calls they made, always train in one mini-batch."""
    if groups_per_mini_batch < 1:
        raise ValueError(f"groups per mini-batch must be >= 1, got {groups_per_mini_batch}")
    group_ids = batch.rows_on_host().group_ids
    order = list(dict.fromkeys(group_ids))
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows_of.setdefault(g, []).append(i)
    out = []
    for s in range(0, len(order), groups_per_mini_batch):
        out.append(batch.select([i for g in order[s : s + groups_per_mini_batch] for i in rows_of[g]]))
    return out


def micro_batches_with_rows(
    batch: Batch, budget: int, shared_prompts: bool = False
) -> list[tuple[Batch, torch.Tensor]]:
    """Token-budget micro-batches of ``batch`` with the row indices (into batch) each one holds."""
    batch.extras["row"] = torch.arange(len(batch), device=batch.input_ids.device)  # (B,)
    split = split_by_token_budget(batch, budget, padded=True, shared_prompts=shared_prompts)
    return [(mb, mb.extras["row"]) for mb in split]
