"""The token-level engine contract: token ids in, token ids and logprobs out.

Logprob definition (shared by every engine and by the trainer): the log-prob of the sampling
policy. For a token sampled at temperature ``T > 0`` it is ``log_softmax(logits / T)[token]`` of the
model's logits at that position; for a greedy request (``T = 0``) ``log_softmax(logits)[token]`` of
the raw logits. Top-p / top-k are NOT renormalised (as verl): the value is the same whether or not
they cut the distribution. The trainer computes old, new and reference log-probs at each sample's
own recorded temperature from its own forward pass, so the two compare token by token (and feed
rollout correction). Engines are exact per row: one batch may mix temperatures and greedy rows.
Where an engine cannot give exactly this (vLLM with top-p / top-k, vllm_engine.py), it says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field

from agentloop.errors import ContextLengthExceededError

FinishReason = Literal["stop", "length", "abort"]

# How an engine takes new weights while requests are in flight (each engine's docstring says how):
# "drain": stop admitting, let in-flight requests finish on the old weights, then load;
# "abort": end in-flight requests at once (finish_reason "abort", partial tokens returned), then load;
# "inflight": load between two decode steps; running requests go on with the new weights (their
# keys/values so far stay those of the old ones), each token labelled with the version that sampled it.
WeightUpdatePolicy = Literal["drain", "abort", "inflight"]
WEIGHT_UPDATE_POLICIES: tuple[WeightUpdatePolicy, ...] = ("drain", "abort", "inflight")


class SamplingParams(BaseModel):
    """How to sample one response. ``temperature`` also sets the logprobs' distribution:
    ``log_softmax(logits / temperature)``, raw logits at 0 (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_tokens: int = Field(256, ge=1, description="Upper bound on generated tokens.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra ids that end generation.")
    stop: list[str] = Field(default_factory=list, description="Strings that end generation (kept in output).")
    seed: int | None = Field(None, description="Per-request seed; same seed, same tokens.")
    logprobs: bool = Field(True, description="Return the logprob of each sampled token.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")


class TokenOutput(BaseModel):
    """The engine's answer to one generate call. ``logprobs[i]`` is the sampling policy's log-prob
    of ``token_ids[i]``: ``log_softmax(logits / T)[token]`` at the request's temperature ``T``, raw
    logits when ``T = 0``, top-p / top-k not renormalised (module docstring); None when not asked for."""

    model_config = ConfigDict(frozen=True)

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: FinishReason
    weights_version: int = 0
    num_cached_prompt_tokens: int = 0
    token_versions: list[int] | None = None
    """The weights version that sampled each token (``weight_update_policy="inflight"`` lets one
    response span versions); None from an engine that does not track it (then every token is
    ``weights_version``'s)."""


def mixed_versions(out: TokenOutput) -> list[int] | None:
    """``out.token_versions`` when the response spans weights versions, else None (one version:
    ``out.weights_version`` says it all, and a span need not store a number per token)."""
    versions = out.token_versions
    return list(versions) if versions and min(versions) != max(versions) else None


@runtime_checkable
class InferenceEngine(Protocol):
    """What the proxy and the trainer need from an inference engine."""

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (with chat template) the engine serves with."""
        ...

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + response) one sequence may hold."""
        ...

    @property
    def weights_version(self) -> int:
        """Bumped by every update_weights."""
        ...

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        """Generate a response; raises ContextLengthExceededError, RequestAbortedError, EngineError."""
        ...

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Load new weights between decode steps; returns the new weights version."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; True when it was found."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters: requests, generated tokens, batch sizes, cache hits."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# ---------------------------------------------------------------- input checks shared by every engine


def check_sampling(sampling: Any) -> SamplingParams:
    """``sampling`` as SamplingParams (None: the defaults; a dict is validated)."""
    if sampling is None:
        return SamplingParams.model_validate({})
    if isinstance(sampling, Mapping):
        return SamplingParams.model_validate(sampling)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
    return sampling


def check_prompt(prompt_ids: Any, vocab_size: int, max_context: int) -> list[int]:
    """A non-empty list of ids in [0, vocab_size) that leaves room for one generated token."""
    if not isinstance(prompt_ids, list | tuple) or not prompt_ids:
        raise ValueError(f"prompt_ids must be a non-empty list of token ids, got {type(prompt_ids).__name__}")
    for i, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_ids[{i}] must be an int in [0, {vocab_size}), got {t!r}")
    if len(prompt_ids) + 1 > max_context:
        raise ContextLengthExceededError(
            f"prompt has {len(prompt_ids)} tokens; the context holds {max_context} "
            f"(prompt + at least 1 generated token); shorten the prompt"
        )
    return list(prompt_ids)


def check_named_tensors(named_tensors: Any, param_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every name is one of the model's parameters and every tensor has that parameter's shape."""
    if not isinstance(named_tensors, Mapping) or not named_tensors:
        raise ValueError("update_weights expects a non-empty mapping of parameter name -> tensor")
    unknown = sorted(k for k in named_tensors if k not in param_shapes)
    if unknown:
        raise ValueError(
            f"update_weights got {len(unknown)} unknown parameter name(s), e.g. {unknown[:3]}; "
            f"expected names of the model's state_dict such as {next(iter(param_shapes))!r}"
        )
    for k, t in named_tensors.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != param_shapes[k]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"update_weights: {k!r} must be a tensor of shape {param_shapes[k]}, got {got}")
