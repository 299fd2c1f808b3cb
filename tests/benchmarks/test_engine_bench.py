"""benchmarks/engine_bench.py --via-proxy on the tiny model: one engine, the same work direct and
through a real proxy + SQLite store, the loss reported (the bench itself checks every proxied call's
prompt ids and sampling against the direct ones)."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from types import ModuleType

import anyio

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_bench.py"


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_via_proxy_reports_the_loss_on_the_same_work(tiny_model_dir: Path) -> None:
    bench = _load_bench()
    agents, new_tokens, reps = 8, 8, 2
    args = argparse.Namespace(
        backend="torch", model="tiny", device="cpu", prompts=agents, new_tokens=new_tokens, reps=reps,
        temperature=0.7, top_p=0.9, store="sqlite", no_cuda_graphs=True, gpu_memory_utilization=0.5,
    )  # fmt: skip
    with anyio.fail_after(120):
        result = await bench.bench_via_proxy(tiny_model_dir, args)
    assert result["mode"] == "via_proxy" and result["backend"] == "torch"
    assert len(result["rounds_direct"]) == len(result["rounds_proxy"]) == reps
    assert all(x > 0 for x in result["rounds_direct"] + result["rounds_proxy"])
    for way in ("direct", "proxy"):
        assert all(0 < t <= agents * new_tokens for t in result["tokens_per_round"][way])
        assert sum(result["finish_reasons"][way].values()) == agents * reps
    loss = 1 - result["proxy_tokens_per_s"] / result["direct_tokens_per_s"]
    assert math.isclose(result["proxy_loss"], loss, abs_tol=1e-3) and result["proxy_loss"] < 1
    assert result["workload"]["stop_token_ids"]  # the chat template's stop ids, replayed in the direct calls
    assert result["workload"]["store"] == "sqlite"
    assert result["weights_versions_recorded"] == [0]  # the proxy recorded the engine's version


def test_random_models_get_the_tokenizer_vocabulary_in_their_own_folder() -> None:
    bench = _load_bench()
    name, folder = bench.tokenizer_vocab_config("qwen2-0.5b", "/tmp/qwen05/")
    assert (name, folder) == ("qwen2-0.5b-vocab49152", "/tmp/qwen05-vocab49152")
    derived, base = bench.RANDOM_CONFIGS[name], bench.RANDOM_CONFIGS["qwen2-0.5b"]
    assert derived["vocab_size"] == 49152 and base["vocab_size"] == 151936
    assert {k: v for k, v in derived.items() if k != "vocab_size"} == {
        k: v for k, v in base.items() if k != "vocab_size"
    }
