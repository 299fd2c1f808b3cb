"""Dealing a batch's micro-batches to data-parallel ranks (trainer/distributed/_sharding.py): every row once, within
the budget, the same on every rank, and the slowest rank padding as little as one rank would."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from trainer.batch import HostRows
from trainer.batch.splits import token_budget_rows
from trainer.distributed._sharding import (
    _deal_even_micro_batches,
    _deal_rows_by_tokens,
    _remembered_deal,
    deal_micro_batches,
    padded_tokens,
)


def _rows(n: int, prompt_len: int, response_len: int, seed: int) -> HostRows:
    """Rows whose prompt and response lengths vary 50-100% of the longest, each on its own (as
    benchmarks/scale_bench.py's batch)."""
    rng = random.Random(seed)
    plen = tuple(rng.randint(prompt_len // 2, prompt_len) for _ in range(n))
    rlen = tuple(rng.randint(response_len // 2, response_len) for _ in range(n))
    return HostRows(plen, rlen, tuple(i // 4 for i in range(n)), tuple(range(n)))


def _slowest(host: HostRows, deal: list[list[list[int]]]) -> int:
    return max(sum(padded_tokens(host, mb) for mb in mbs) for mbs in deal)


def test_padded_tokens_is_rows_times_the_longest_prompt_and_response() -> None:
    host = HostRows((3, 5, 1), (4, 2, 6), (0, 0, 1), (0, 1, 2))
    assert padded_tokens(host, [0, 1, 2]) == 3 * (5 + 6)
    assert padded_tokens(host, [1]) == 7
    assert padded_tokens(host, []) == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 8, 30, 128])
def test_every_row_once_within_the_budget_and_the_same_on_every_call(world: int, n: int) -> None:
    budget = 4000
    host = _rows(n, 300, 300, seed=n * 10 + world)
    deal = deal_micro_batches(host, budget, world)
    assert len(deal) == world
    assert sorted(i for mbs in deal for mb in mbs for i in mb) == list(range(n))
    assert all(mb for mbs in deal for mb in mbs)  # no empty micro-batch (padding is rank_micro_batches')
    assert all(padded_tokens(host, mb) <= budget or len(mb) == 1 for mbs in deal for mb in mbs)
    _remembered_deal.cache_clear()
    assert deal == deal_micro_batches(host, budget, world)  # every rank computes the same deal


def test_a_deal_is_computed_once_for_the_same_rows_and_callers_cannot_change_it() -> None:
    host = _rows(40, 300, 300, seed=7)
    _remembered_deal.cache_clear()
    first = deal_micro_batches(host, 2000, 4)
    expected = [[list(mb) for mb in mbs] for mbs in first]
    first[0][0].append(999)  # a caller's change to its copy
    first[1].clear()
    again = deal_micro_batches(HostRows(*(tuple(f) for f in vars(host).values())), 2000, 4)  # equal rows
    assert again == expected
    info = _remembered_deal.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert deal_micro_batches(host, 2001, 4) != [] and _remembered_deal.cache_info().misses == 2


@pytest.mark.parametrize("seed", range(20))
def test_even_micro_batches_hold_every_row_within_the_rank_cap(seed: int) -> None:
    """The by-micro-batches deal on its own: every row once, each rank at most as many micro-batches as
    the whole batch's split needs per rank, none over the budget but a row longer than it."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 8])
    host = _rows(rng.randint(1, 200), rng.choice([64, 512]), rng.choice([64, 512]), seed)
    budget = rng.choice([300, 2048, 16384])  # 300: below many rows' length
    deal = _deal_even_micro_batches(host, budget, world)
    assert sorted(i for mbs in deal for mb in mbs for i in mb) == list(range(len(host.prompt_tokens)))
    cap = -(-len(token_budget_rows(host, budget, padded=True)) // world)
    assert max(map(len, deal)) <= cap
    assert all(padded_tokens(host, mb) <= budget or len(mb) == 1 for mbs in deal for mb in mbs)


def test_an_empty_batch_deals_nothing() -> None:
    empty = HostRows((), (), (), ())
    assert deal_micro_batches(empty, 100, 3) == [[], [], []]


def test_rows_longer_than_the_budget_go_alone() -> None:
    host = _rows(12, 300, 300, seed=4)  # every row 300-600 tokens, the budget 250
    deal = deal_micro_batches(host, 250, 4)
    assert sorted(len(mb) for mbs in deal for mb in mbs) == [1] * 12
    assert [len(mbs) for mbs in deal] == [3, 3, 3, 3]


@pytest.mark.parametrize(
    "n, prompt_len, response_len, budget, world, seed",
    [(91, 64, 512, 1000, 3, 503), (66, 64, 64, 300, 3, 738), (134, 512, 32, 1000, 2, 811)],
)
def test_fewer_micro_batches_a_rank_come_before_fewer_padded_tokens(
    n: int, prompt_len: int, response_len: int, budget: int, world: int, seed: int
) -> None:
    """Each micro-batch costs its collectives and launches: the deal never adds one to a rank to save
    padding. In these batches (found by a search) the even split pads the slowest rank less than dealing
    rows, but with one more micro-batch on some rank, so dealing rows wins."""
    host = _rows(n, prompt_len, response_len, seed)
    even, by_rows = _deal_even_micro_batches(host, budget, world), _deal_rows_by_tokens(host, budget, world)
    assert _slowest(host, even) < _slowest(host, by_rows)
    assert max(map(len, even)) > max(map(len, by_rows))
    assert deal_micro_batches(host, budget, world) == by_rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_ranks_pad_about_as_little_as_one(seed: int) -> None:
    """scale_bench's batch (128 rows of 256-512 prompt and 256-512 response tokens, a 16,384-token
    budget) on 4 ranks: dealing rows by tokens gives the slowest rank 5-7% more padded tokens than a
    quarter of what one rank computes (each rank's micro-batches mix long and short rows); dealing
    micro-batches of similar lengths 1.4-2% (seeds 0-2; 0-2.5% over seeds 0-7)."""
    host = _rows(128, 512, 512, seed)
    one_rank = sum(padded_tokens(host, mb) for mb in token_budget_rows(host, 16384, padded=True))
    by_rows = _slowest(host, _deal_rows_by_tokens(host, 16384, 4))
    slowest = _slowest(host, deal_micro_batches(host, 16384, 4))
    assert by_rows > 1.04 * one_rank / 4  # what the test guards against
    assert slowest < 1.025 * one_rank / 4, (slowest, one_rank / 4, by_rows)


def _sum_gradients_in_rank(rank: int, port: int, out: Any) -> None:
    """One of two gloo ranks: gradients of two dtypes and sizes (fp64 values that fp32 cannot hold), one
    parameter without a gradient on either rank, one without it on rank 1 only, and a bucket cap of 64
    bytes, summed by all_reduce_gradients (in their own dtypes, then in bf16); the all-reduces counted."""
    import torch.distributed as dist

    from trainer.distributed import _sharding

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = [0]
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        _sharding.GRADIENT_BUCKET_BYTES = 64  # 16 fp32 values: several buckets
        shapes = [(3, 5), (7,), (2, 2), (4,), (9,), (3,)]
        dtypes = [torch.float32, torch.float32, torch.float32, torch.float64, torch.float32, torch.float32]
        params = [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
        for i, p in enumerate(params):
            if i != 2 and not (i == 5 and rank == 1):  # 2: no rank has a gradient; 5: rank 0 only
                p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
        params[3].grad += 2**-40  # lost if the fp64 gradient went through fp32 (in an fp32 bucket)
        _sharding.all_reduce_gradients(params)
        exact = [None if p.grad is None else p.grad.clone() for p in params]
        reduces = calls[0]
        for p in params:
            p.grad = torch.full_like(p, 1.0 + 2**-12 if rank == 0 else 1.0)
        _sharding.all_reduce_gradients(params, torch.bfloat16)
        # NumPy arrays cross the queue by value: a tensor is shared through this process's file
        # descriptors and is gone if the rank exits before the test reads it (FileNotFoundError under load)
        rounded = [p.grad.numpy().copy() for p in params]
        out.put((rank, [None if g is None else g.numpy() for g in exact], reduces, rounded))
    finally:
        dist.destroy_process_group()


def test_all_reduce_gradients_sums_every_gradient_in_buckets_of_one_dtype() -> None:
    """Two ranks: each gradient is the sum of both ranks' (a rank without one adds zeros; with none on
    any rank it stays None, so AdamW skips it as on one device), in buckets of one dtype each (the fp64
    one summed in fp64) and of the capped size, and a bf16 reduction rounds as bf16 does."""
    import multiprocessing
    import queue

    from trainer.distributed.data_parallel import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_sum_gradients_in_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted((out.get(timeout=120) for _ in procs), key=lambda r: r[0])
    except queue.Empty:
        pytest.fail(f"a rank gave no result in 120 s (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    shapes = [(3, 5), (7,), (2, 2), (4,), (9,), (3,)]
    for _, arrays, reduces, rounded_arrays in results:
        exact = [None if a is None else torch.from_numpy(a) for a in arrays]
        rounded = [torch.from_numpy(a) for a in rounded_arrays]
        # a bucket takes gradients of its dtype until it holds 64 bytes:
        # [counts, 15 + 7 fp32], [4 fp32], [4 fp64], [9 + 3 fp32]
        assert reduces == 4, reduces
        assert exact[2] is None, "no rank had a gradient: it must stay None, not become zeros"
        for i in (0, 1, 3, 4, 5):
            g = exact[i]
            base = torch.arange(g.numel(), dtype=g.dtype).reshape(shapes[i])
            want = base + 5 if i == 5 else base * 3 + 2 * i  # rank 0's alone; else (1 + 2) * base + i + i
            if i == 3:
                want = want + 2 * 2**-40
            assert g.dtype == (torch.float64 if i == 3 else torch.float32)
            assert torch.equal(g, want), (i, g, want)
        # 1 + 2^-12 rounds to 1 in bf16 (8 bits of mantissa): the sum is 2 exactly; fp32 would give 2 + 2^-12
        assert all(torch.equal(g, torch.full_like(g, 2.0)) for g in rounded), rounded
