"""The JSON bodies of the Tinker routes this server answers, and forward_backward's data checked.

Request models ignore fields they do not know (a newer SDK may send more), and type-check the ones
they use: a bad body is answered 400 with pydantic's message. ``Datum`` is a training example once
checked: its tokens, and each loss input as a float32 (N,) tensor aligned with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from agentloop.tinker._proto import RawForwardBackward
from agentloop.tinker.losses import LOSS_INPUTS, check_loss

__all__ = [
    "AdamParams",
    "CreateModelRequest",
    "CreateSamplingSessionRequest",
    "CreateSessionRequest",
    "Datum",
    "ForwardBackward",
    "FutureRetrieveRequest",
    "GetInfoRequest",
    "LoadWeightsRequest",
    "LoraConfig",
    "OptimStepRequest",
    "SampleRequest",
    "SamplingParams",
    "SaveWeightsForSamplerRequest",
    "SaveWeightsRequest",
    "SessionHeartbeatRequest",
    "WireError",
    "check_name",
    "forward_backward_from_proto",
]


class WireError(ValueError):
    """A request the server cannot take as it is (HTTP 400); the message says what to send."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionRequest(_Body):
    tags: list[str] = Field(default_factory=list, description="Free-form labels of the session.")
    user_metadata: dict[str, Any] | None = Field(None, description="What the client says about itself.")
    sdk_version: str = Field("", description="The SDK's version string.")


class SessionHeartbeatRequest(_Body):
    session_id: str = Field(description="The session to keep alive.")


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=1024, description="LoRA rank.")
    seed: int | None = Field(None, description="Seed of the adapters' initialisation.")
    train_unembed: bool = Field(True, description="LoRA on the output projection (lm_head).")
    train_mlp: bool = Field(True, description="LoRA on the MLP projections.")
    train_attn: bool = Field(True, description="LoRA on the attention projections.")


class CreateModelRequest(_Body):
    session_id: str = Field(description="The session the training model belongs to.")
    model_seq_id: int = Field(ge=0, description="The model's number within its session.")
    base_model: str = Field(description="The model to fine-tune: this server's model name or path.")
    lora_config: LoraConfig | None = Field(None, description="None: full fine-tuning (not served here).")
    optimizer_config: dict[str, Any] | None = Field(None, description="{'type': 'adamw'} is served.")
    user_metadata: dict[str, Any] | None = Field(None, description="Kept with the model.")


class GetInfoRequest(_Body):
    model_id: str = Field(description="A training model's id.")


class AdamParams(_Body):
    learning_rate: float = Field(1e-4, ge=0.0, description="Step size.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="First-moment decay.")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="Second-moment decay.")
    eps: float = Field(1e-12, gt=0.0, description="Denominator term.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay (AdamW).")
    grad_clip_norm: float = Field(0.0, ge=0.0, description="Clip the global gradient norm to this; 0: off.")


class OptimStepRequest(_Body):
    model_id: str = Field(description="The training model to step.")
    adam_params: AdamParams | None = Field(None, description="The SDK's name for Adam's parameters.")
    optimizer_params: dict[str, Any] | None = Field(None, description="Other optimizers (refused here).")
    seq_id: int | None = Field(None, description="The request's place in the model's order.")


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str, what: str = "path") -> str:
    """A checkpoint name: letters, digits, '.', '_', '-' (no '/'); WireError otherwise."""
    if not _NAME.match(name) or ".." in name:
        raise WireError(
            f"{what} {name!r} is not a checkpoint name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


class SaveWeightsRequest(_Body):
    model_id: str = Field(description="The training model to save.")
    path: str | None = Field(None, description="The checkpoint's name; None: one is made up.")
    seq_id: int | None = Field(None, description="The request's place in the model's order.")


class SaveWeightsForSamplerRequest(_Body):
    model_id: str = Field(description="The training model whose weights to sample from.")
    path: str | None = Field(
        None, description="A name: a saved sampler checkpoint; None: a sampling session."
    )
    sampling_session_seq_id: int | None = Field(None, description="The sampling session's number.")
    kind: str = Field("snapshot", description="snapshot: the weights of this moment.")
    seq_id: int | None = Field(None, description="The request's place in the model's order.")


class LoadWeightsRequest(_Body):
    path: str = Field(description="tinker://RUN/weights/NAME, as save_weights answered.")
    optimizer: bool = Field(False, description="Also restore Adam's state.")
    model_id: str | None = Field(None, description="Load into this existing training model.")
    seq_id: int | None = Field(None, description="The request's place in the model's order.")
    session_id: str | None = Field(None, description="Create a new training model in this session.")
    model_seq_id: int | None = Field(None, description="The new model's number within its session.")
    base_model: str | None = Field(None, description="Must be the checkpoint's base model.")


class CreateSamplingSessionRequest(_Body):
    session_id: str = Field(description="The session it belongs to.")
    sampling_session_seq_id: int = Field(ge=0, description="Its number within the session.")
    base_model: str | None = Field(None, description="Sample the base model.")
    model_path: str | None = Field(None, description="tinker://RUN/sampler_weights/NAME.")


class SamplingParams(_Body):
    max_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate; None: up to the context."
    )
    seed: int | None = Field(None, description="Same seed, same tokens.")
    stop: str | list[str] | list[int] | None = Field(
        None, description="Stop strings or token ids; None: stop at EOS; []: not even at EOS."
    )
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0: greedy.")
    top_k: int = Field(-1, ge=-1, description="-1: no top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass.")


class _ModelInput(_Body):
    chunks: list[dict[str, Any]] = Field(
        description="Token chunks: {'type': 'encoded_text', 'tokens': [...]}."
    )

    def tokens(self) -> list[int]:
        out: list[int] = []
        for i, chunk in enumerate(self.chunks):
            kind = chunk.get("type", "encoded_text")
            if kind != "encoded_text":
                raise WireError(f"prompt.chunks[{i}] is a {kind!r} chunk; only token chunks are served")
            tokens = chunk.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                raise WireError(f"prompt.chunks[{i}].tokens must be a list of token ids (ints >= 0)")
            out.extend(tokens)
        return out


class SampleRequest(_Body):
    prompt: _ModelInput = Field(description="The prompt's tokens.")
    sampling_params: SamplingParams = Field(description="How to sample.")
    num_samples: int = Field(1, ge=1, le=256, description="Independent samples of the prompt.")
    sampling_session_id: str | None = Field(None, description="The sampler to use.")
    seq_id: int | None = Field(None, description="The request's number in its sampling session.")
    base_model: str | None = Field(None, description="Sample the base model (without a session).")
    model_path: str | None = Field(None, description="Sample saved sampler weights (without a session).")
    prompt_logprobs: bool | None = Field(None, description="Also the prompt tokens' logprobs.")
    topk_prompt_logprobs: int = Field(0, description="Refused when > 0.")
    topk_sample_logprobs: int = Field(0, description="Refused when > 0.")
    target_prompt_logprobs: dict[str, Any] | None = Field(None, description="Refused.")
    prompt_alt_tokens_k: int = Field(0, description="Refused when > 0.")
    prompt_logprobs_last_n: int | None = Field(None, ge=1, description="Score only the last N prompt tokens.")


class FutureRetrieveRequest(_Body):
    request_id: str = Field(description="The id a submission answered.")
    allow_metadata_only: bool = Field(False, description="Ignored: results are always sent whole.")


@dataclass
class Datum:
    """One training example: ``tokens`` (N,) and each loss input as a float32 tensor (N,)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]
    target_tokens: torch.Tensor  # (N,) int64


@dataclass
class ForwardBackward:
    model_id: str
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def forward_backward_from_proto(raw: RawForwardBackward, vocab_size: int) -> ForwardBackward:
    """``raw`` checked: a served loss, its inputs present and aligned with each datum's tokens."""
    if not raw.data:
        raise WireError("forward_backward needs at least one datum")
    config = check_loss(raw.loss_fn, raw.loss_fn_config)
    needed = ("target_tokens", *LOSS_INPUTS[raw.loss_fn])
    data: list[Datum] = []
    for i, d in enumerate(raw.data):
        n = len(d.tokens)
        if n == 0:
            raise WireError(f"data[{i}].model_input has no tokens")
        if min(d.tokens) < 0 or max(d.tokens) >= vocab_size:
            raise WireError(f"data[{i}].model_input holds token ids outside [0, {vocab_size})")
        missing = [k for k in needed if k not in d.loss_fn_inputs]
        if missing:
            raise WireError(
                f"data[{i}].loss_fn_inputs lacks {missing}: {raw.loss_fn} takes {', '.join(needed)}"
            )
        arrays: dict[str, np.ndarray] = {}
        for key in needed:
            arr = d.loss_fn_inputs[key].to_numpy(f"data[{i}].loss_fn_inputs[{key!r}]")
            if arr.ndim != 1 or arr.shape[0] != n:
                raise WireError(
                    f"data[{i}].loss_fn_inputs[{key!r}] has shape {list(arr.shape)}; this server takes ({n},), "
                    f"one value per model_input token (top-k / 2-D targets are not served)"
                )
            if not np.all(np.isfinite(arr)):
                raise WireError(f"data[{i}].loss_fn_inputs[{key!r}] holds NaN or infinite values")
            arrays[key] = arr
        targets = arrays.pop("target_tokens").astype(np.int64)
        if targets.min() < 0 or targets.max() >= vocab_size:
            raise WireError(f"data[{i}].loss_fn_inputs['target_tokens'] holds ids outside [0, {vocab_size})")
        data.append(
            Datum(
                tokens=list(d.tokens),
                inputs={k: torch.from_numpy(v.astype(np.float32)) for k, v in arrays.items()},
                target_tokens=torch.from_numpy(targets),
            )
        )
    return ForwardBackward(raw.model_id, raw.loss_fn, config, raw.forward_only, data)


StopReason = Literal["stop", "length"]
