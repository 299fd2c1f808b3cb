"""The engine contract suite runs over every engine in ENGINES.

The vllm leg needs vLLM and a GPU (it runs on the GPU machine; elsewhere it is skipped with a
visible reason). vLLM starts in tens of seconds, so one engine serves the whole session (fp32, to
match the fp32 reference forward to 1e-4); its counters are reset before each test. Tests that
reach into the torch model object (forward hooks, ``engine.model``) or assume token-granular
prefix caching are replaced for vLLM by tests/engine/test_vllm_engine.py (see VLLM_REPLACED).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

ENGINES = ["torch", "vllm"]
VLLM_SKIP_REASON = "vLLM not installed (runs on the GPU machine)"
VLLM_REPLACED = {
    "test_update_weights": "uses engine.model (a torch module); see test_vllm_engine.py",
    "test_update_weights_drains_in_flight_requests": "uses engine.model; see test_vllm_engine.py",
    "test_a_failing_step_fails_only_its_requests": "hooks the in-process torch model",
    "test_prefix_reuse_for_the_next_turn": "vLLM caches whole 16-token blocks; see test_vllm_engine.py",
}
VLLM_TEST_KWARGS: dict[str, Any] = dict(
    dtype="float32", gpu_memory_utilization=0.25, enforce_eager=True, max_batch_size=64, live_stats=True
)


def vllm_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def make_engine(kind: str, model_dir: Path, **kwargs: Any) -> Any:
    if kind == "torch":
        import torch

        from agentloop.engine.torch.engine import TorchEngine

        # AGENTLOOP_TEST_DEVICE=cuda runs the torch leg on the GPU (fp32, to match the fp32 references)
        device = os.environ.get("AGENTLOOP_TEST_DEVICE", "cpu")
        return TorchEngine(model_dir, device=device, dtype=torch.float32, **kwargs)
    if kind == "vllm":
        if not vllm_available():
            pytest.skip(VLLM_SKIP_REASON)
        from agentloop.engine.vllm_engine import VLLMEngine

        kwargs.pop("max_batch_size", None)
        return VLLMEngine(model_dir, **{**VLLM_TEST_KWARGS, **kwargs})
    raise ValueError(f"unknown engine kind {kind!r}")


@pytest.fixture(params=ENGINES)
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def vllm_engine_session(tiny_model_dir: Path) -> Iterator[Any]:
    """One vLLM engine (max_context 512) for the whole session; it runs its own event loop thread,
    so every test's event loop can use it."""
    eng = make_engine("vllm", tiny_model_dir, max_context=512)
    yield eng
    asyncio.run(eng.stop())


@pytest.fixture
async def engine(
    engine_kind: str, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    if engine_kind == "vllm":
        if not vllm_available():
            pytest.skip(VLLM_SKIP_REASON)
        name = request.node.originalname
        if name in VLLM_REPLACED:
            pytest.skip(f"vllm leg: {VLLM_REPLACED[name]}")
        eng = request.getfixturevalue("vllm_engine_session")
        await eng.start()
        eng.reset_stats()
        yield eng
        return
    eng = make_engine(engine_kind, tiny_model_dir, max_batch_size=16, max_context=512)
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture
def chat_prompt(tiny_model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, return_dict=False
    )
    return list(ids)


# ---------------------------------------------------------------- the sampling policy's log-probs

EPS32 = 1.1920928955078125e-07  # torch.finfo(torch.float32).eps
# An engine's logits and a full forward's come from the same fp32 weights through reductions of at
# most ~128 terms (hidden 64, MLP 128, attention over the context) summed in different orders
# (KV-cached batched decode or one full forward; MKL-packed or plain GEMMs; AVX2 or AVX-512 blocks,
# or a GPU's), so they differ by rounding only: about sqrt(128) ~ 11 ulps of the largest logit at
# worst along one reduction chain. Allowed: 32 ulps (the tiny model, |logit| <= ~20: 7.6e-5; the
# dev machine measured 1.4e-5).
LOGIT_ULPS = 32


def policy_logprobs(
    model: Any, prompt_ids: list[int], token_ids: list[int], temperature: float, top_k: int = 0
) -> tuple[Any, Any]:
    """The sampling policy's log-prob of each response token from ``model``'s own full forward (fp32,
    CPU): ``log_softmax(logits / T)[token]``, raw logits when ``T == 0`` (base.py). With ``top_k``,
    renormalised over the top-k set (what vLLM's ``processed_logprobs`` reports, vllm_engine.py).

    Returns ``(reference (n,), tolerance (n,))``: ``log_softmax(x / T)[i] = x_i / T - lse(x / T)``
    moves by at most ``2 * d / T`` when every logit moves by at most ``d`` (``d``: LOGIT_ULPS ulps of
    the position's largest logit); so does the renormalised ``x_i / T - lse(top-k of x / T)``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(token_ids)])).logits[0].float()
    logits = logits[len(prompt_ids) - 1 : -1]  # (n, V): the logits each response token was drawn from
    t = temperature if temperature > 0 else 1.0
    lp = (logits / t).log_softmax(-1)
    ref = lp.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    d = LOGIT_ULPS * EPS32 * logits.abs().amax(-1)  # (n,)
    if top_k > 0:
        ref = ref - lp.topk(top_k, dim=-1).values.logsumexp(-1)
    return ref, 2 * d / t
