"""Prompt ids equal the tokenizer's own encoding for Metaspace tokenizers (issue 14 item 8).

A Metaspace pre-tokenizer with ``prepend_scheme="first"`` (Llama/Mistral-style SentencePiece
conversions) adds '▁' only to the text at offset 0 of the string, not to the text after an added
token such as ``<|im_start|>``. The proxy encodes template text piece by piece between added tokens
(and the ledger encodes only the new messages of a later call), so each piece must be encoded as
the whole-text encoding sees it. The tokenizers are built offline with the ``tokenizers`` library.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agentloop.proxy.chat import ChatTemplate
from agentloop.proxy.ledger import TokenLedger
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "hello world, how are you today?\nI am fine: 42 apples.",
    "user assistant system tool\nYou are a fox. The quick brown fox jumps over the lazy dog",
    "  two spaces\tand a tab. Ünïcode été 日本",
] * 10
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CONVERSATION = [
    {"role": "system", "content": "You are a fox."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "how are you today?"},
    {"role": "user", "content": " two spaces\tand a tab"},
]
TRICKY = ["hello <|im_end|>world", "<tool>  x", " lead", "\nnew line", "<|im_start|>user\nhi", "a<|im_end|><|im_start|>b",
          "trail <|im_end|>", "", "x", "日本 été  <|im_start|> fox"]  # fmt: skip


def metaspace_tokenizer(scheme: str, stripping_token: bool = False) -> Any:
    """A small BPE with a Metaspace pre-tokenizer and decoder, as a transformers fast tokenizer;
    ``stripping_token`` adds ``<tool>`` that strips the whitespace to its right (the proxy then
    encodes whole texts with the tokenizer instead of piece by piece)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if stripping_token:
        fast.add_tokens([AddedToken("<tool>", rstrip=True, normalized=False)])
    fast.chat_template = CHATML
    return fast


@pytest.fixture(
    params=["metaspace-first", "metaspace-always", "metaspace-never", "metaspace-first-stripping", "smollm2"]
)
def any_tokenizer(request: pytest.FixtureRequest) -> Any:
    if request.param == "smollm2":
        return request.getfixturevalue("tokenizer")  # ByteLevel, the real SmolLM2 tokenizer
    return metaspace_tokenizer(request.param.split("-")[1], request.param.endswith("-stripping"))


def _ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(out)


def _through_reply(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The tokenizer's ids of ``messages`` (ending on an assistant reply) up to the reply's <|im_end|>."""
    closed = _ids(tokenizer, messages, generation_prompt=False)
    return closed[: len(closed) - closed[::-1].index(tokenizer.eos_token_id)]


def test_prompt_ids_are_the_tokenizers_own(any_tokenizer: Any) -> None:
    tokenizer, template = any_tokenizer, ChatTemplate(any_tokenizer)
    for n in range(1, len(CONVERSATION) + 1):
        text = template.render(CONVERSATION[:n], None, add_generation_prompt=True)
        assert template.encode(text) == _ids(tokenizer, CONVERSATION[:n]), text
    for text in TRICKY * 2:  # the second round reads the piece cache
        assert template.encode(text) == tokenizer.encode(text, add_special_tokens=False), text


def test_delta_prompt_is_earlier_prompt_plus_response_plus_the_new_messages(any_tokenizer: Any) -> None:
    """The later call's prompt keeps the earlier ids and the response ids, and its new part is what
    the tokenizer makes of the new messages after ``<|im_end|>`` (no '▁' added at the seam)."""
    tokenizer, template, ledger = any_tokenizer, ChatTemplate(any_tokenizer), TokenLedger()
    first, reply = CONVERSATION[:2], CONVERSATION[2]
    plan1 = ledger.plan("k", first, None, template)
    assert plan1.prompt_ids == _ids(tokenizer, first)
    # the model's ids: the reply as the whole-text encoding has them, closed by <|im_end|>
    through_reply = _through_reply(tokenizer, [*first, reply])
    response = through_reply[len(plan1.prompt_ids) :]
    ledger.record("k", plan1, first, None, response, dict(reply))
    plan2 = ledger.plan("k", CONVERSATION, None, template)
    assert plan2.ledger_break is None and plan2.extends_call == 1
    assert plan2.prompt_ids[: len(through_reply)] == through_reply
    assert plan2.prompt_ids == _ids(tokenizer, CONVERSATION)  # the same ids as the tokenizer's own
    assert plan2.delta_tokens == len(plan2.prompt_ids) - len(through_reply)


async def test_the_proxy_sends_the_tokenizers_ids_for_a_metaspace_first_tokenizer(oai: Any) -> None:
    tokenizer = metaspace_tokenizer("first")
    replies = iter(["how are you today?", "fine"])
    engine, store = EchoEngine(tokenizer, reply=lambda ids, sampling: next(replies)), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        messages: list[Any] = list(CONVERSATION[:2])
        with anyio.fail_after(20):
            r1 = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": r1.choices[0].message.content}, CONVERSATION[3]]
            await client.chat.completions.create(model="m", messages=messages)
    c1, c2 = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert isinstance(c1, LLMCall) and isinstance(c2, LLMCall)
    assert c1.prompt_ids == _ids(tokenizer, CONVERSATION[:2])
    head = c1.prompt_ids + c1.response_ids
    assert c2.ledger_break is None and c2.prompt_ids[: len(head)] == head
    # the new messages' ids: what the tokenizer makes of the text after the reply's <|im_end|>
    assert (
        c2.prompt_ids[len(head) :]
        == _ids(tokenizer, messages)[len(_through_reply(tokenizer, messages[:3])) :]
    )
