"""The engine contract suite runs over every engine in ENGINES (vllm can join later)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

ENGINES = ["torch"]


def make_engine(kind: str, model_dir: Path, **kwargs: Any) -> Any:
    if kind == "torch":
        from agentloop.engine.torch_engine import TorchEngine

        return TorchEngine(model_dir, device="cpu", **kwargs)
    raise ValueError(f"unknown engine kind {kind!r}")


@pytest.fixture(params=ENGINES)
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def engine(engine_kind: str, tiny_model_dir: Path) -> AsyncIterator[Any]:
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
