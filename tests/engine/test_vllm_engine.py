"""VLLMEngine: weight updates, drain policy and block-granular prefix reuse on the GPU machine (the
contract suite in test_contract.py covers the rest), plus the parts that run anywhere: the logprob
gap metric, the lazy export and the error when vLLM is missing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.errors import EngineError
from tests.engine.conftest import VLLM_SKIP_REASON, policy_logprobs, vllm_available

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
needs_vllm = pytest.mark.skipif(not vllm_available(), reason=VLLM_SKIP_REASON)


def _checkpoint_tensor(model_dir: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))[name]


# ---------------------------------------------------------------- anywhere


def test_logprob_gap_values() -> None:
    from agentloop.engine.vllm_engine import logprob_gap

    gap = logprob_gap([-1.0, -2.0, -0.5], [-1.1, -2.0, -0.3])
    assert gap["mean_abs"] == pytest.approx(0.1)
    assert gap["max_abs"] == pytest.approx(0.2)
    assert gap["mean"] == pytest.approx((0.1 + 0.0 - 0.2) / 3)
    with pytest.raises(ValueError, match="one length"):
        logprob_gap([-1.0], [-1.0, -2.0])
    with pytest.raises(ValueError, match="non-empty"):
        logprob_gap([], [])


async def test_reference_logprobs_match_the_torch_engine(
    tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    """The trainer-side reference (what the gap is measured against) at the sampling temperature
    agrees with an engine's logprobs (the sampling policy's, base.py) to fp32 rounding on CPU."""
    from transformers import AutoModelForCausalLM

    from agentloop.engine.torch.engine import TorchEngine
    from agentloop.engine.vllm_engine import logprob_gap, reference_logprobs

    eng = TorchEngine(tiny_model_dir, device="cpu")
    try:
        with anyio.fail_after(30):
            out = await eng.generate(chat_prompt, SamplingParams(temperature=1.2, max_tokens=12, seed=4))
    finally:
        await eng.stop()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = reference_logprobs(model, chat_prompt, out.token_ids, temperature=1.2)
    _, tol = policy_logprobs(model, chat_prompt, out.token_ids, 1.2)  # fp32 rounding: see there
    assert out.logprobs is not None
    assert logprob_gap(out.logprobs, ref)["max_abs"] <= float(tol.min())
    at_one = reference_logprobs(model, chat_prompt, out.token_ids)  # the default: temperature 1
    assert logprob_gap(out.logprobs, at_one)["max_abs"] > 10 * float(tol.max())  # T matters
    raw, _ = policy_logprobs(model, chat_prompt, out.token_ids, 0.0)
    greedy = reference_logprobs(model, chat_prompt, out.token_ids, temperature=0.0)  # raw logits
    assert logprob_gap(greedy, raw)["max_abs"] <= float(tol.min())
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        reference_logprobs(model, chat_prompt, out.token_ids, temperature=-1.0)


class _FakeAsyncLLM:
    """The calls ``VLLMEngine._load`` makes on vLLM's AsyncLLM, recorded with the weights version a
    request would be labelled with at each; a request admitted when generation resumes is at once
    labelled (as a fast one can be)."""

    def __init__(self, engine: Any, fail_load: bool = False) -> None:
        self.engine, self.fail_load = engine, fail_load
        self.calls: list[tuple[str, int]] = []

    def _record(self, name: str) -> None:
        self.calls.append((name, self.engine.weights_version))

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        assert clear_cache and mode == ("wait" if self.engine._policy == "drain" else "abort")
        assert not self.engine._resumed_event().is_set()  # resumed requests wait for the new weights
        self._record("pause")

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[int]:
        await asyncio.sleep(0)
        if self.fail_load:
            raise RuntimeError("worker died")
        self._record(method)
        return [1]

    async def reset_prefix_cache(self) -> None:
        self._record("reset_prefix_cache")

    async def resume_generation(self) -> None:
        self._record("resume")


def _engine_without_vllm() -> Any:
    """A VLLMEngine holding only the state ``_load`` touches (vLLM cannot start here)."""
    from agentloop.engine.vllm_engine import VLLMEngine

    eng = object.__new__(VLLMEngine)
    eng._policy, eng._weights_version = "drain", 3
    eng._live, eng._preempted, eng._resumed = {}, {}, None
    eng._llm = _FakeAsyncLLM(eng)
    return eng


async def test_weights_version_moves_before_generation_resumes() -> None:
    """A request that starts as generation resumes runs on the new weights, so it must see the new
    version; a failed load keeps the old one and still resumes generation."""
    eng = _engine_without_vllm()
    assert await eng._load(b"packed") == 4 == eng.weights_version
    assert eng._llm.calls == [
        ("pause", 3), ("agentloop_load_packed", 3), ("reset_prefix_cache", 4), ("resume", 4)
    ]  # fmt: skip
    eng._llm = _FakeAsyncLLM(eng, fail_load=True)
    with pytest.raises(RuntimeError, match="worker died"):
        await eng._load(b"packed")
    assert eng.weights_version == 4 and eng._llm.calls == [("pause", 4), ("resume", 4)]


async def test_an_inflight_update_marks_the_running_requests_for_resuming() -> None:
    """issue 20: under "inflight" the requests running when the update starts are marked pre-empted
    (``_generate`` resumes them with their tokens once generation resumes); "drain" marks none."""
    eng = _engine_without_vllm()
    eng._live = {"req-a": "req-a", "req-b": "req-b#resume1"}
    await eng._load(b"packed")
    assert eng._preempted == {} and eng._resumed_event().is_set()
    eng._policy = "inflight"
    await eng._load(b"packed")
    assert eng._preempted == {"req-a": True, "req-b": True} and eng._resumed_event().is_set()


def test_lazy_export_and_missing_vllm(tiny_model_dir: Path) -> None:
    from agentloop.engine import VLLMEngine
    from agentloop.engine.factory import load_engine

    assert VLLMEngine.__name__ == "VLLMEngine"
    if vllm_available():
        pytest.skip("vLLM is installed here; the missing-vLLM error cannot be shown")
    with pytest.raises(EngineError, match=r"\.\[vllm\]"):
        load_engine(str(tiny_model_dir), device="cpu", backend="vllm")
    with pytest.raises(EngineError, match="not installed"):
        VLLMEngine(tiny_model_dir)


# ---------------------------------------------------------------- GPU machine


@needs_vllm
async def test_update_weights_changes_output_and_restores(
    vllm_engine_session: Any, tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    eng = vllm_engine_session
    name = "model.embed_tokens.weight"
    original = _checkpoint_tensor(tiny_model_dir, name)
    with anyio.fail_after(120):
        v0 = eng.weights_version
        before = await eng.generate(chat_prompt, GREEDY)
        v1 = await eng.update_weights({name: torch.randn_like(original).cuda()})
        after = await eng.generate(chat_prompt, GREEDY)
        assert v1 == v0 + 1 == eng.weights_version == after.weights_version
        assert before.weights_version == v0
        assert after.token_ids != before.token_ids
        assert after.num_cached_prompt_tokens == 0  # the prefix cache went with the old weights
        assert eng.last_update["tensors"] == 1 and eng.last_update["total_s"] > 0
        v2 = await eng.update_weights({name: original})  # CPU tensors are accepted too
        restored = await eng.generate(chat_prompt, GREEDY)
    assert v2 == v1 + 1 and restored.token_ids == before.token_ids
    with pytest.raises(ValueError, match="unknown parameter"):
        await eng.update_weights({"model.nope.weight": original})
    with pytest.raises(ValueError, match="shape"):
        await eng.update_weights({name: original[:3]})
    assert eng.weights_version == v2


@needs_vllm
async def test_update_weights_drains_in_flight_requests(
    vllm_engine_session: Any, chat_prompt: list[int]
) -> None:
    eng = vllm_engine_session
    eng.reset_stats()
    name = "model.norm.weight"
    norm = torch.ones(eng.param_shapes[name])
    with anyio.fail_after(120):
        v0 = eng.weights_version
        running = asyncio.ensure_future(
            eng.generate(chat_prompt, GREEDY.model_copy(update={"max_tokens": 300}))
        )
        while eng.stats().get("generated_tokens", 0) < 2:
            await asyncio.sleep(0.005)
        version = await eng.update_weights({name: norm * 1.0})  # the tiny model's norm weights are ones
        out = await running
    assert out.finish_reason == "length" and len(out.token_ids) == 300
    assert out.weights_version == v0 and version == v0 + 1
    assert await eng.param_sum("model.norm.weight") == pytest.approx(float(norm.sum()))


@needs_vllm
async def test_prefix_reuse_is_block_granular(vllm_engine_session: Any, chat_prompt: list[int]) -> None:
    eng = vllm_engine_session
    with anyio.fail_after(60):
        turn1 = await eng.generate(chat_prompt, GREEDY)
        turn2_prompt = chat_prompt + turn1.token_ids + [198, 1, 4093, 198, 28, 2, 198]
        turn2 = await eng.generate(turn2_prompt, GREEDY)
        shared = len(chat_prompt) + len(turn1.token_ids) - 1  # the last response token has no KV yet
        assert (shared // 16) * 16 <= turn2.num_cached_prompt_tokens <= shared
        assert turn2.num_cached_prompt_tokens > 0
        # same weights again: clears the prefix cache, so the next call computes everything afresh
        name = "model.norm.weight"
        await eng.update_weights({name: torch.ones(eng.param_shapes[name])})
        fresh = await eng.generate(turn2_prompt, GREEDY)
    assert fresh.num_cached_prompt_tokens == 0 and fresh.token_ids == turn2.token_ids
