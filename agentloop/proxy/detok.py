"""Token ids -> text: the tokenizer's Rust backend directly, where that is exactly ``tokenizer.decode``.

A Hugging Face fast tokenizer's ``decode(ids, skip_special_tokens=True)`` first converts ``ids`` to a
Python list one element at a time (``to_py_obj``). Then it calls its backend's ``decode`` and, when
``clean_up_tokenization_spaces`` is set, cleans the text up. For an answer of 128 ids the conversion is
about half of the ~40 us the call takes on a 2-core CPU, and the proxy decodes every answer.
``text_decoder`` returns the backend's ``decode`` when the tokenizer does no clean-up and both
agree on a probe (every added token, and runs of ids across the vocabulary). Otherwise, and for
slow tokenizers, it returns ``tokenizer.decode`` itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Decode = Callable[[list[int]], str]  # ids -> text, special tokens skipped


def _probe_ids(tokenizer: Any, size: int) -> list[list[int]]:
    """Id sequences that cover the added tokens, the start of the vocabulary and random runs."""
    rng = random.Random(0)
    added = sorted((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    runs = [list(range(i, min(i + 16, size))) for i in range(0, min(size, 2048), 16)]
    runs += [[rng.randrange(size) for _ in range(32)] for _ in range(64)]
    return [added, *([a, *run] for a in added[:4] for run in runs[:4]), *runs]


def text_decoder(tokenizer: Any) -> Decode:
    """The cheapest exact ``ids -> tokenizer.decode(ids, skip_special_tokens=True)`` (module docstring)."""

    def slow(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return slow

    def fast(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    try:
        same = all(fast(ids) == slow(ids) for ids in _probe_ids(tokenizer, len(tokenizer)))
    except Exception:  # a tokenizer that refuses some probe id: keep its own decode
        return slow
    return fast if same else slow
