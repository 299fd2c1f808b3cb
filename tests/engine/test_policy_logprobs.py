"""TorchEngine's log-probs are those of the sampling policy (base.py): ``log_softmax(logits / T)`` at
each sampled token of a row sampled at temperature ``T > 0``, ``log_softmax(logits)`` for a greedy
row, top-k / top-p not renormalised. Checked token by token against the model's own full forward
(fp32, CPU) for one batch that mixes greedy, T = 0.7 and T = 1.3 rows with plain, top-p and top-k
sampling (two rows repeat a prompt, so they share one prefill), on each decode path: transformers'
forward with eager sampling, the hand-written CPU decoder, and the static path CUDA graphs capture
(bucketed batch shapes, top-k / top-p by radix select). The first token of every row comes from
the batched prefill, the others from decode steps."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from tests.engine.conftest import make_engine, policy_logprobs

# (temperature, top_p, top_k): every mode at T = 0.7, greedy rows, and T = 1.3 rows
ROWS = [
    (0.7, 1.0, 0),
    (0.7, 0.8, 0),
    (0.7, 1.0, 20),
    (0.0, 1.0, 0),
    (1.3, 1.0, 0),
    (1.3, 0.9, 0),
    (1.3, 0.95, 30),
    (0.0, 1.0, 0),
]


def _prompts(chat_prompt: list[int]) -> list[list[int]]:
    """One prompt per row, of different lengths (the prefill pads); rows 4 and 5 repeat row 0's."""
    out = [chat_prompt[: len(chat_prompt) - i % 3] + [700 + 11 * i] * (i % 4) for i in range(len(ROWS))]
    out[4] = out[5] = out[0]
    return out


async def _one_batch(engine: Any, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    """Generate so that all requests are admitted in one prefill group and decoded together: a
    greedy blocker runs while a pending weight update (drain policy; the same weights) holds
    admissions, so every request is waiting when the blocker ends."""
    blocker = asyncio.ensure_future(
        engine.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    )
    while engine.stats().get("generated_tokens", 0) < 2:
        await asyncio.sleep(0.005)
    name = "model.norm.weight"
    update = asyncio.ensure_future(engine.update_weights({name: engine.model.state_dict()[name].clone()}))
    outs = await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)])
    await asyncio.gather(blocker, update)
    assert engine.stats()["prefill_batches"] == 2, "the rows were not admitted as one group"
    return list(outs)


@pytest.mark.parametrize("path", ["eager", "cpu_decoder", "static"])
async def test_logprobs_are_the_sampling_policys(
    path: str, tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    from transformers import AutoModelForCausalLM

    engine = make_engine("torch", tiny_model_dir, max_batch_size=16, max_context=512,
                         cpu_decoder=path == "cpu_decoder")  # fmt: skip
    if path == "static":
        engine._runner.graph_shapes = engine._runner.static_sampling = True
    prompts = _prompts(chat_prompt)
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=12, seed=i, ignore_eos=True)
        for i, (t, p, k) in enumerate(ROWS)
    ]
    try:
        with anyio.fail_after(120):
            outs = await _one_batch(engine, prompts, params)
    finally:
        await engine.stop()
    if path == "cpu_decoder" and engine._device.type == "cpu":
        assert engine._runner.decoder is not None
    assert engine.stats()["shared_prompt_prefills"] == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for (t, p, k), prompt, out in zip(ROWS, prompts, outs, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
        ref, tol = policy_logprobs(model, prompt, out.token_ids, t)  # tol: see policy_logprobs
        err = (torch.tensor(out.logprobs) - ref).abs()
        assert bool((err <= tol).all()), (
            f"T={t} top_p={p} top_k={k}: |engine - policy| {err.tolist()} > {tol.tolist()}"
        )
