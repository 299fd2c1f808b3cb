"""benchmarks/engine_bench.py --via-proxy on the tiny model: one engine, the same work direct and
through a real proxy + SQLite store, with the agents in processes of their own or in the proxy's; the
loss reported (the bench itself checks every proxied call's prompt ids and sampling against the
direct ones)."""

from __future__ import annotations

import argparse
import gc
import math
import statistics
from pathlib import Path

import anyio
import pytest

from tests.benchmarks import load_benchmark


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("agent_procs", "proxy_workers"),
    [(2, 0), (0, 0), (2, 2)],
    ids=["agents-in-2-processes", "agents-in-process", "agents-in-2-processes-proxy-workers-2"],
)
async def test_via_proxy_reports_the_loss_on_the_same_work(
    tiny_model_dir: Path, agent_procs: int, proxy_workers: int
) -> None:
    bench = load_benchmark("engine_bench")
    agents, new_tokens, reps = 8, 8, 2
    args = argparse.Namespace(
        backend="torch", model="tiny", device="cpu", prompts=agents, new_tokens=new_tokens, reps=reps,
        temperature=0.7, top_p=0.9, store="sqlite", no_cuda_graphs=True, no_idle_capture=False,
        gpu_memory_utilization=0.5,
        agent_procs=agent_procs, gc_freeze=agent_procs > 0, proxy_workers=proxy_workers,
    )  # fmt: skip
    with anyio.fail_after(120):
        result = await bench.bench_via_proxy(tiny_model_dir, args)
    assert result["mode"] == "via_proxy" and result["backend"] == "torch"
    assert result["agents_in"] == ("2 processes" if agent_procs else "the proxy's process")
    assert result["proxy_workers"] == proxy_workers
    assert len(result["rounds_direct"]) == len(result["rounds_proxy"]) == reps
    assert all(x > 0 for x in result["rounds_direct"] + result["rounds_proxy"])
    for way in ("direct", "proxy"):
        assert all(0 < t <= agents * new_tokens for t in result["tokens_per_round"][way])
        assert sum(result["finish_reasons"][way].values()) == agents * reps
    proxy, direct = result["proxy_tokens_per_s"], result["direct_tokens_per_s"]
    loss = 1 - proxy / direct
    # both rates are reported rounded to 0.1 tok/s and proxy_loss to 1e-4: 1 - proxy / direct moves by up to
    # 0.05 * (1 + proxy / direct) / direct + 5e-5 (over 1e-3 below ~100 tok/s: a 2-core CPU makes ~70)
    loss_tol = 0.05 * (1 + proxy / direct) / direct + 5e-5
    assert math.isclose(result["proxy_loss"], loss, abs_tol=loss_tol) and result["proxy_loss"] < 1
    assert result["workload"]["stop_token_ids"]  # the chat template's stop ids, replayed in the direct calls
    assert result["workload"]["store"] == "sqlite"
    assert result["weights_versions_recorded"] == [0]  # the proxy recorded the engine's version
    # every proxied call's time splits into the engine's part and the rest, all of it after the send
    lat = result["proxied_call_latency_ms"]
    assert 0 < lat["engine_generate"]["median"] <= lat["client"]["median"]
    assert lat["send_to_engine"]["median"] > 0 and lat["engine_to_received"]["median"] > 0
    assert 0 <= lat["client_send_spread"]["median"] <= lat["client_send_spread"]["max"]
    assert (
        lat["added"]["max"] <= lat["client"]["max"] and lat["send_to_engine"]["max"] <= lat["client"]["max"]
    )
    # the proxied round's milestones, in the order a round passes them, ending at the round's own end
    path = result["proxied_round_critical_path_ms"]
    order = ["first_engine_in", "last_engine_in", "last_engine_out", "last_received"]
    assert 0 < path["last_send"] <= path["last_engine_in"] and all(path[k] > 0 for k in path)
    assert [path[k] for k in order] == sorted(path[k] for k in order)
    assert path["first_engine_in"] <= path["first_engine_out"] <= path["last_engine_out"]
    round_ms = [
        1e3 * t / x for t, x in zip(result["tokens_per_round"]["proxy"], result["rounds_proxy"], strict=True)
    ]
    assert path["last_received"] == pytest.approx(statistics.median(round_ms), rel=1e-2)
    assert result["direct_round_ms_median"] > 0
    assert set(result["full_gc_in_timed_rounds"]) == {"direct", "proxy"}
    for way, work in result["engine_work_in_timed_rounds"].items():  # the engine's own counters, per way
        assert work["prefill_batches"] >= reps and work["decode_steps"] > 0 and work["decode_s"] > 0
        # each request's first token comes from its prefill, every other one from a decode row
        assert work["decode_rows"] == sum(result["tokens_per_round"][way]) - agents * reps
    assert gc.isenabled()  # the bench leaves the collector on


@pytest.mark.e2e
async def test_agent_processes_fail_loudly() -> None:
    """An agent process that fails or exits says so (its traceback, or its pid and exit code) instead
    of hanging the bench."""
    bench = load_benchmark("engine_bench")
    procs = await bench.AgentProcesses.start(2)
    try:
        await procs._send(procs.procs[1], {"not": "a round"})  # the worker fails on the job: an error line
        with pytest.raises(RuntimeError, match="expected a 'ready' line"):
            await procs._recv(procs.procs[1], "ready", 30)
        stdin = procs.procs[0].stdin
        assert stdin is not None
        stdin.close()  # end of input: the worker exits
        with pytest.raises(RuntimeError, match=r"exited \(0\)"):
            await procs._recv(procs.procs[0], "ready", 30)
    finally:
        await procs.close()
    assert all(p.returncode == 0 for p in procs.procs)


def test_random_models_get_the_tokenizer_vocabulary_in_their_own_folder() -> None:
    bench = load_benchmark("engine_bench")
    name, folder = bench.tokenizer_vocab_config("qwen2-0.5b", "/tmp/qwen05/")
    assert (name, folder) == ("qwen2-0.5b-vocab49152", "/tmp/qwen05-vocab49152")
    derived, base = bench.RANDOM_CONFIGS[name], bench.RANDOM_CONFIGS["qwen2-0.5b"]
    assert derived["vocab_size"] == 49152 and base["vocab_size"] == 151936
    assert {k: v for k, v in derived.items() if k != "vocab_size"} == {
        k: v for k, v in base.items() if k != "vocab_size"
    }
