"""text_decoder: the backend's decode where it equals tokenizer.decode, the tokenizer's own otherwise."""

from __future__ import annotations

import copy
import random
from typing import Any

from agentloop.proxy.detok import text_decoder


def test_the_fast_decoder_gives_the_tokenizers_text_for_any_ids(tokenizer: Any) -> None:
    decode = text_decoder(tokenizer)
    assert decode.__name__ == "fast"  # SmolLM2's tokenizer: a fast tokenizer without clean-up
    rng = random.Random(1)
    specials = list(tokenizer.added_tokens_decoder)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 64))]
        ids[rng.randrange(len(ids) + 1) : 0] = rng.sample(specials, 2)  # special ids inside: skipped
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids
    text = 'naïve 日本 🙂 <tool_call>{"a": 1}</tool_call>'
    assert decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer: Any) -> None:
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert text_decoder(cleaning).__name__ == "slow"


def test_a_backend_that_disagrees_with_the_tokenizer_is_not_used(tokenizer: Any) -> None:
    class Lowercasing:  # decode post-processes the backend's text, as some tokenizer classes do
        clean_up_tokenization_spaces = False
        backend_tokenizer = tokenizer.backend_tokenizer
        added_tokens_decoder = tokenizer.added_tokens_decoder

        def __len__(self) -> int:
            return len(tokenizer)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)).lower()

    decode = text_decoder(Lowercasing())
    ids = tokenizer.encode("Hello World", add_special_tokens=False)
    assert decode.__name__ == "slow" and decode(ids) == "hello world"
