"""The engine factory (agentloop.engine.factory.load_engine) and (slow) the real SmolLM2 end to end."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agentloop.engine.base import SamplingParams
from agentloop.engine.factory import load_engine
from agentloop.engine.torch.engine import TorchEngine
from agentloop.errors import EngineError


async def test_load_engine(tiny_model_dir: Path) -> None:
    eng = load_engine(str(tiny_model_dir), device="auto", max_batch_size=4)
    assert isinstance(eng, TorchEngine)
    try:
        with anyio.fail_after(30):
            out = await eng.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3
    finally:
        await eng.stop()
    with pytest.raises(ValueError, match="backend"):
        load_engine(str(tiny_model_dir), backend="onnx")
    with pytest.raises(ValueError, match="device"):
        load_engine(str(tiny_model_dir), device="tpu")


def test_vllm_backend_without_vllm(tiny_model_dir: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(EngineError, match="vllm"):
        load_engine(str(tiny_model_dir), backend="vllm")


@pytest.mark.slow
async def test_real_smollm2_end_to_end() -> None:
    eng = load_engine("smollm2-135m-instruct", device="cpu")
    try:
        tok = eng.tokenizer
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        with anyio.fail_after(120):
            out = await eng.generate(list(ids), SamplingParams(temperature=0, max_tokens=24))
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        assert "Paris" in text, text
        assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    finally:
        await eng.stop()
