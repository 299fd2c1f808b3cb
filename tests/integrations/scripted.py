"""A scripted engine for tool-path tests: the real proxy, store and runner, with the model's choices fixed.

A random tiny model rarely writes a valid ``<tool_call>``, so these tests replay scripted assistant
texts. ``scripted_engine(tokenizer, script)`` is the proxy tests' EchoEngine (a real InferenceEngine:
the text is encoded by the real tokenizer and closed with the end-of-turn id) answering turn k of a
conversation with ``script[k]`` (the turn is the number of assistant turns already in the prompt).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from agentloop.engine.base import SamplingParams
from tests.proxy.engines import EchoEngine

Script = Sequence[str] | Callable[[str, int], str]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """What a hermes-style model writes to call a tool."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def turn_of(prompt_text: str) -> int:
    """How many assistant turns the prompt already holds (0 on the first call)."""
    return prompt_text.count("<|im_start|>assistant") - 1


def scripted_engine(tokenizer: Any, script: Script, **kwargs: Any) -> EchoEngine:
    """An engine that answers turn k with ``script[k]`` (the last entry repeats), or ``script(prompt, k)``."""

    def reply(prompt_ids: list[int], sampling: SamplingParams) -> str:
        text = tokenizer.decode(prompt_ids)
        turn = turn_of(text)
        if callable(script):
            return script(text, turn)
        return script[min(turn, len(script) - 1)]

    return EchoEngine(tokenizer, reply=reply, **kwargs)
