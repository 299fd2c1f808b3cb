"""What the update reads back from the device: the rows' lengths and groups live on the host, and the
micro-batch loop reads nothing back, so on a GPU its kernels queue without waiting (a CPU-GPU sync
leaves the GPU idle while the host prepares the next kernels)."""

from __future__ import annotations

import collections
import random
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from agentloop.types import Triplet
from tests.trainer.samples import actor_config
from trainer.batch import Batch, HostRows, build_batch
from trainer.batch.splits import split_by_groups, split_by_token_budget
from trainer.distributed._sharding import deal_micro_batches, rank_micro_batches
from trainer.model.actor import Actor

_T = torch.Tensor
# the calls that copy a GPU tensor's values to the host, so wait for every kernel queued before them
_READS_BACK = {
    *(_T.item, _T.__float__, _T.__int__, _T.__bool__, _T.__index__, _T.tolist, _T.numpy, _T.cpu),
    *(_T.nonzero, torch.nonzero, _T.unique, torch.unique, torch.equal, _T.masked_select, torch.masked_select),
}
_TRAINER = str(Path(__file__).resolve().parents[3] / "trainer")
_TORCH = str(Path(torch.__file__).parent)


class _ReadBacks(TorchFunctionMode):
    """Counts the read-backs made directly by code under ``under`` (trainer/; None: any code outside
    torch), by call site. Not the graphs dynamo generates: they read the layers' float attributes (an
    RMSNorm's epsilon) from the CPU scalars dynamo lifted them into, which on a GPU stay on the host too."""

    def __init__(self, under: str | None = _TRAINER) -> None:
        super().__init__()
        self.under = under
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS_BACK or (func is _T.__getitem__ and _bool_index(args)):
            # the first frame outside torch (torch.unique runs through torch/functional.py)
            caller = next(
                f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith(_TORCH)
            )
            if self._counted(caller.filename):
                self.sites[f"{Path(caller.filename).name}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))

    def _counted(self, filename: str) -> bool:
        if self.under is None:
            return not filename.startswith("<eval_with_key>")
        return filename.startswith(self.under)


def _bool_index(args: Any) -> bool:
    """A boolean-mask index: its result's size depends on the mask's values."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


def _triplets(n: int, seed: int = 0) -> list[Triplet]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 12))] for _ in range((n + 3) // 4)]
    return [
        Triplet(
            prompt_ids=prompts[i // 4],  # a group's attempts share their prompt
            response_ids=[rng.randrange(3, 500) for _ in range(rng.randint(1, 10))],
            reward=float(rng.random() < 0.5),
            metadata={"group_id": i // 4},
        )
        for i in range(n)
    ]


def _batch(n: int, seed: int = 0) -> Batch:
    batch, _ = build_batch(_triplets(n, seed), max_prompt_length=16, max_response_length=16)
    return batch


def _from_tensors(batch: Batch) -> HostRows:
    return HostRows.of(batch)


def test_build_batch_records_what_the_tensors_hold() -> None:
    batch = _batch(12)
    assert batch.host_rows == _from_tensors(batch)
    assert batch.rows_on_host().sequence_tokens() == batch.sequence_lengths().tolist()


def test_selections_and_splits_keep_the_host_rows_true() -> None:
    batch = _batch(24, seed=3)
    rng = random.Random(1)
    for _ in range(20):
        rows = rng.sample(range(len(batch)), rng.randint(1, len(batch)))
        part = batch.select(rows)
        assert part.host_rows == _from_tensors(part)
        assert part.host_rows == batch.rows_on_host().take(rows)
        assert part.fully_real() == bool(part.attention_mask.all())
    for part in [*split_by_token_budget(batch, 40, padded=True), *split_by_groups(batch, 2)]:
        assert part.host_rows == _from_tensors(part)
    full = batch.select([0])
    assert full.fully_real() and bool(full.attention_mask.all())


def test_a_batch_without_host_rows_reads_them_from_its_tensors() -> None:
    batch = _batch(8)
    batch.host_rows = None
    assert batch.rows_on_host() == _from_tensors(batch)
    stale = _batch(8)
    stale.host_rows = stale.rows_on_host().take([0, 1])  # rows of another selection
    assert stale.rows_on_host() == _from_tensors(stale)


def test_select_takes_a_tensor_of_rows_too() -> None:
    batch = _batch(8)
    by_list, by_tensor = batch.select([5, 1, 2]), batch.select(torch.tensor([5, 1, 2]))
    assert torch.equal(by_list.input_ids, by_tensor.input_ids)
    assert by_list.host_rows == by_tensor.host_rows
    assert by_list.metadata == [batch.metadata[i] for i in (5, 1, 2)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_counts_the_same_padded_micro_batches_without_a_collective(world: int) -> None:
    """rank_micro_batches pads each rank to the most micro-batches any rank has, counted on the host
    from the rows' lengths (no all-reduce): checked against the deal every rank computes."""
    batch = _batch(30, seed=7)
    budget = 60
    deal = deal_micro_batches(batch.rows_on_host(), budget, world)
    most = max(len(mbs) for mbs in deal)
    for rank in range(world):
        mine = rank_micro_batches(batch, budget, rank, world)
        assert len(mine) == most
        own = len(deal[rank])
        assert [rows.tolist() for _, rows in mine[:own]] == deal[rank]
        for mb, rows in mine[:own]:
            assert torch.equal(mb.input_ids, batch.select(rows.tolist()).input_ids)
        for mb, rows in mine[own:]:  # padding: one row, nothing to train
            assert len(rows) == 0 and int(mb.response_mask.sum()) == 0


def _loop_read_backs(model_dir: Path, budget: int, estimator: str) -> tuple[collections.Counter[str], int]:
    config = actor_config(model_dir, ppo_max_token_len_per_gpu=budget)  # the shared-prompt forward on
    actor = Actor(config.with_overrides([f"algorithm.adv_estimator={estimator}"]), model_dir, "cpu")
    batch = _batch(16, seed=5)
    forwards = 0
    forward = actor._forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    actor._forward = counted  # type: ignore[method-assign]
    counter = _ReadBacks()
    with counter:
        actor.update(batch)
    return counter.sites, forwards


@pytest.mark.parametrize("estimator", ["grpo", "gae"])  # gae: the critic's update too
def test_the_update_reads_back_the_same_whatever_its_micro_batches(
    tiny_model_dir: Path, estimator: str
) -> None:
    """The read-backs of an update do not grow with its micro-batches: none inside the loops. (Before:
    six a micro-batch, each making the GPU wait for the host between forward and backward.)"""
    few, few_forwards = _loop_read_backs(tiny_model_dir, 10_000, estimator)
    many, many_forwards = _loop_read_backs(tiny_model_dir, 16, estimator)
    assert many_forwards > few_forwards + 8  # the small budget really made more micro-batches
    assert many == few, f"read-backs by site: {dict(few)} vs {dict(many)}"


def test_host_prompt_ids_find_the_same_shared_prompts_as_the_device(tiny_model_dir: Path) -> None:
    """shared_prompt_hidden with the host's prompt ids (no read-back) gives the hidden states the
    device's torch.unique path gives."""
    from trainer.model.actor import load_policy
    from trainer.model.hidden import shared_prompt_hidden

    decoder = load_policy(tiny_model_dir, torch.device("cpu")).get_decoder()
    batch = _batch(12, seed=2).select([0, 4, 1, 8, 5, 2, 9])  # groups 0, 1, 2 interleaved
    ids = batch.rows_on_host().prompt_ids
    assert len(set(ids)) == 3 and ids == _from_tensors(batch).prompt_ids
    p, r = batch.prompt_length, batch.response_length
    with torch.no_grad():
        args = (decoder, batch.input_ids, batch.attention_mask, batch.position_ids, p, r)
        on_host, on_device = shared_prompt_hidden(*args, ids), shared_prompt_hidden(*args)
    assert on_host is not None and on_device is not None
    torch.testing.assert_close(on_host, on_device)
