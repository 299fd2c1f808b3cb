"""EngineReplicaPool over two real TorchEngine replicas (Ray actors on CPU): sticky routing, load
balancing, weight sync to every replica, errors that keep their type."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.replicas import EngineReplicaPool, routing_key
from agentloop.errors import ContextLengthExceededError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, ray_local: None) -> Iterator[EngineReplicaPool]:
    import ray

    p = EngineReplicaPool.create(str(tiny_model_dir), 2, "cpu", max_context=256, max_batch_size=8)
    yield p
    for r in p.replicas:
        ray.kill(r)


def test_routing_key() -> None:
    assert routing_key("rid/aid/req-1") == "rid/aid"
    assert routing_key("session/s1/req-1") == "session/s1"
    assert routing_key("req-1") is None
    assert routing_key(None) is None
    assert routing_key("/req-1") is None


def test_pool_validates_input() -> None:
    with pytest.raises(ValueError, match="non-empty list of replica actor handles"):
        EngineReplicaPool([])
    with pytest.raises(ValueError, match="cpu_binding must be one of none, numa, exclusive, got 'all'"):
        EngineReplicaPool.create("/nowhere", 2, cpu_binding="all")  # type: ignore[arg-type]  # before any actor


@pytest.mark.e2e
async def test_calls_of_one_attempt_stay_on_one_replica(pool: EngineReplicaPool) -> None:
    before = list(pool.stats()["routed"])
    with anyio.fail_after(60):
        for i in range(5):
            out = await pool.generate([1, 2, 3 + i], GREEDY, request_id=f"rollout-a/attempt-1/req-{i}")
            assert len(out.token_ids) == 4
    delta = [a - b for a, b in zip(pool.stats()["routed"], before, strict=True)]
    assert sorted(delta) == [0, 5], delta


@pytest.mark.e2e
async def test_new_attempts_go_to_the_least_loaded_replica(pool: EngineReplicaPool) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    with anyio.fail_after(120):
        busy = asyncio.ensure_future(pool.generate([5, 6, 7], long, request_id="rollout-b/attempt-1/req-0"))
        await asyncio.sleep(0.05)
        busy_idx = pool.pick("rollout-b/attempt-1/req-x")
        routed = []
        for i in range(3):  # one request in flight on busy_idx: every new attempt goes to the other
            before = list(pool.stats()["routed"])
            await pool.generate([1, 2, i + 3], GREEDY, request_id=f"rollout-c{i}/attempt-1/req-0")
            routed.append([a - b for a, b in zip(pool.stats()["routed"], before, strict=True)].index(1))
        assert not busy.done(), "the long request should still be running"
        assert routed == [1 - busy_idx] * 3
        await busy

        before = list(pool.stats()["routed"])
        await asyncio.gather(
            *[pool.generate([1, 2, 3], GREEDY, request_id=f"rollout-d{i}/attempt-1/req-0") for i in range(8)]
        )
        delta = [a - b for a, b in zip(pool.stats()["routed"], before, strict=True)]
        assert delta == [4, 4], delta
    assert pool.stats()["in_flight"] == [0, 0]


@pytest.mark.e2e
async def test_update_weights_reaches_every_replica(pool: EngineReplicaPool, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert pool.weight_update_policy == "drain"  # the replicas' engines say how they take weights
    prompt = [1, 9, 4, 22]
    with anyio.fail_after(120):
        old = [(await r.generate.remote(prompt, GREEDY, None)).token_ids for r in pool.replicas]
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        torch.manual_seed(1)
        weights = {k: v + 0.5 * torch.randn_like(v) for k, v in model.state_dict().items()}
        version = await pool.update_weights(weights)
        new = [(await r.generate.remote(prompt, GREEDY, None)).token_ids for r in pool.replicas]
        infos = [await r.info.remote() for r in pool.replicas]
    assert version == pool.weights_version >= 1
    assert [i["weights_version"] for i in infos] == [version, version]
    assert new[0] == new[1] and old[0] == old[1]
    assert new[0] != old[0], "new weights must change the greedy output"
    assert pool.stats()["last_sync_s"] > 0
    with pytest.raises(ValueError, match="non-empty mapping"):
        await pool.update_weights({})


@pytest.mark.e2e
async def test_replica_errors_keep_their_type(pool: EngineReplicaPool) -> None:
    with anyio.fail_after(30), pytest.raises(ContextLengthExceededError):
        await pool.generate([3] * 300, GREEDY, request_id="rollout-e/attempt-1/req-0")
    assert pool.max_context == 256
    assert pool.tokenizer.eos_token_id is not None
    assert await pool.abort("not-in-flight") is False


@pytest.mark.e2e
async def test_a_burst_goes_out_in_one_stream_and_cancelling_one_aborts_only_it(
    pool: EngineReplicaPool,
) -> None:
    """Requests made in one tick reach their replica in one streaming call; results still come back
    one by one, and a cancelled request is aborted on its replica while its batch-mates finish."""
    before = await pool.replica_stats()
    long = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    with anyio.fail_after(60):
        tasks = [
            asyncio.ensure_future(pool.generate([5, 6, 7, 8 + i], long if i == 0 else GREEDY, f"burst-{i}/r"))
            for i in range(6)
        ]
        await asyncio.sleep(0)  # all six are queued in this tick
        assert sum(len(p) for p in pool._pending) == 6
        done, _ = await asyncio.wait(tasks[1:])
        assert all(len(t.result().token_ids) == 4 for t in done)
        assert not tasks[0].done()  # the long one is still running: results come back one by one
        tasks[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        while sum(s["running"] for s in await pool.replica_stats()) > 0:
            await asyncio.sleep(0.01)
    after = await pool.replica_stats()
    aborted = [
        a.get("finished_abort", 0) - b.get("finished_abort", 0) for a, b in zip(after, before, strict=True)
    ]
    sent = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    assert sum(sent) == 6
    assert sum(aborted) == 1, [
        {k: v for k, v in a.items() if k.startswith(("finished", "generated", "requests"))} for a in after
    ]
    assert pool.stats()["in_flight"] == [0, 0]
