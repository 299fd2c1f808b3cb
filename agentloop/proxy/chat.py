"""Chat templating with the engine's tokenizer: OpenAI messages -> template text -> token ids.

The template is compiled once (the same sandboxed jinja environment transformers uses) and rendered
directly, which is several times cheaper than ``tokenizer.apply_chat_template`` per request.

Templates that know nothing of tools (SmolLM2's) still get them: the tool schemas go into the
system message in the hermes format, and earlier assistant tool calls are rendered inline as
``<tool_call>{json}</tool_call>``, the same text the model is asked to produce.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jinja2

from agentloop.proxy.schemas import ChatMessage, JSONDict, ToolSpec, bad_request

# Tokens that end a turn in common chat formats; those present in the vocabulary become stop ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")

_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    try:  # the very environment transformers renders with (cached per template string)
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(source)  # type: ignore[no-any-return]
    except ImportError:  # pragma: no cover - older/newer transformers without the helper
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(source)


def _arguments_object(arguments: str | JSONDict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # kept as the string the client sent


def canonical_message(msg: ChatMessage, index: int) -> JSONDict:
    """The semantic form of a message: role, text content, tool calls without ids.

    Used both to render the template and to compare a returned assistant message with the
    response the proxy produced (ids and formatting of ``arguments`` do not matter).
    """
    role = "system" if msg.role == "developer" else msg.role
    content = msg.content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"only text content parts are supported, got type {part.type!r}",
                    param=f"messages.{index}.content.{j}",
                )
            parts.append(part.text)
        content = "".join(parts)
    out: JSONDict = {"role": role, "content": content or ""}
    if msg.tool_calls:
        if role != "assistant":
            raise bad_request(
                "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
            )
        out["tool_calls"] = [
            {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)}
            for c in msg.tool_calls
        ]
    if role in ("tool", "function") and msg.name:
        out["name"] = msg.name
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    return out


def canonical_response(content: str | None, tool_calls: Sequence[JSONDict]) -> JSONDict:
    """The semantic form of the assistant message the proxy returned."""
    out: JSONDict = {"role": "assistant", "content": content or ""}
    if tool_calls:
        out["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}
            for c in tool_calls
        ]
    return out


def hermes_tool_call_text(call: JSONDict) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": call["name"], "arguments": call["arguments"]})
        + "\n</tool_call>"
    )


class ChatTemplate:
    """Renders canonical messages with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        source = template if template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):  # several named templates: take the default one
            source = source.get("default") or next(iter(source.values()))
        if not source:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template; pass template= to the proxy"
            )
        self.source: str = source
        self.tokenizer = tokenizer
        self._template = compile_template(source)
        self.supports_tools = "tools" in source
        self.supports_tool_calls = "tool_calls" in source
        self._special = {
            k: v
            for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
            if isinstance(v, str)
        }
        self.stop_token_ids = end_of_turn_ids(tokenizer)
        self.stop_texts = [tokenizer.convert_ids_to_tokens(i) for i in self.stop_token_ids]
        self._pieces = PieceEncoder.for_tokenizer(tokenizer)
        self._anchor = _anchor_token(tokenizer)

    def _for_template(self, messages: Sequence[JSONDict], tools: list[JSONDict] | None) -> list[JSONDict]:
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m:
                if self.supports_tool_calls:
                    m["tool_calls"] = [{"type": "function", "function": c} for c in m["tool_calls"]]
                else:
                    calls = "\n".join(hermes_tool_call_text(c) for c in m.pop("tool_calls"))
                    m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
            out.append(m)
        if tools and not self.supports_tools:
            block = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render(
        self, messages: Sequence[JSONDict], tools: list[JSONDict] | None, add_generation_prompt: bool
    ) -> str:
        """The template text of ``messages``; a template error (roles must alternate...) is a 400."""
        try:
            return self._template.render(
                messages=self._for_template(messages, tools),
                tools=tools if self.supports_tools else None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
        except jinja2.TemplateError as exc:
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None

    def encode(self, text: str, *, follows_token: bool = False) -> list[int]:
        """Token ids of template text; special-token text (``<|im_start|>``) becomes its single id.

        ``follows_token``: ``text`` continues a prompt right after a token already in it (the
        ledger's delta after ``<|im_end|>``), so it is encoded as the tokenizer encodes text after an
        added token, not as the start of a string (a Metaspace ``prepend_scheme="first"`` pre-tokenizer
        adds '▁' only at the start).
        """
        if self._pieces is not None:
            return self._pieces.encode(text, follows_token=follows_token)
        if follows_token and self._anchor is not None and text:
            ids = list(self.tokenizer.encode(self._anchor[0] + text, add_special_tokens=False))
            if ids[:1] == [self._anchor[1]]:
                return ids[1:]
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class PieceEncoder:
    """Encodes template text piece by piece between added tokens, caching the pieces.

    A Hugging Face fast tokenizer cuts added tokens (``<|im_start|>``, ``<|im_end|>``) out of the text
    before anything else and encodes the pieces between them separately (``for_tokenizer`` refuses
    tokenizers whose added tokens strip neighbouring whitespace, where that would not hold). Separately,
    but not alone: each piece keeps its offset in the string, and a Metaspace pre-tokenizer with
    ``prepend_scheme="first"`` adds '▁' only to the piece at offset 0. So a piece that follows an added
    token is encoded behind one (``anchor + piece``, the anchor's id dropped), which is exactly how
    the whole text's encoding sees it, whatever the pre-tokenizer; only a piece at the very start of
    the text is encoded alone. Template pieces repeat across requests (system prompts, tool blocks,
    role headers, a GRPO group's shared prompt), so the cache turns most of the tokenization into
    dict lookups.
    """

    MAX_ENTRIES = 8192  # pieces cached; the cache is cleared when full
    MAX_PIECE_CHARS = 8192  # longer pieces are encoded but not cached

    def __init__(self, backend: Any, added: dict[str, int], anchor: str) -> None:
        self._backend = backend
        self._added = added
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
        )
        self._anchor, self._anchor_id = anchor, added[anchor]
        self._cache: dict[str, list[int]] = {}  # pieces that follow an added token
        self._first_cache: dict[str, list[int]] = {}  # pieces at the start of a text

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PieceEncoder | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(tokenizer, "added_tokens_decoder", None)
        if backend is None or not decoder:
            return None
        tokens = list(decoder.items())
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for _, t in tokens):
            return None
        added = {t.content: i for i, t in tokens}
        for anchor, tid in added.items():  # an anchor that starts no longer added token, checked once
            if any(o != anchor and o.startswith(anchor) for o in added):
                continue
            if backend.encode(anchor + "a", add_special_tokens=False).ids[:1] == [tid]:
                return cls(backend, added, anchor)
        return None

    def encode(self, text: str, follows_token: bool = False) -> list[int]:
        """The ids of ``text``; ``follows_token``: it continues after a token (see ChatTemplate.encode)."""
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if not piece:
                continue
            tid = self._added.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            at_start = i == 0 and not follows_token  # the split's first piece is the text's start
            cache = self._first_cache if at_start else self._cache
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece, at_start)
                if len(piece) <= self.MAX_PIECE_CHARS:
                    if len(cache) >= self.MAX_ENTRIES:
                        cache.clear()
                    cache[piece] = ids
            out.extend(ids)
        return out

    def _encode_piece(self, piece: str, at_start: bool) -> list[int]:
        if at_start:
            return list(self._backend.encode(piece, add_special_tokens=False).ids)
        ids = self._backend.encode(self._anchor + piece, add_special_tokens=False).ids
        if ids[:1] != [self._anchor_id]:  # pragma: no cover - for_tokenizer picks an anchor no piece extends
            raise RuntimeError(f"added token {self._anchor!r} did not encode to its own id first: {ids[:3]}")
        return list(ids[1:])


def _anchor_token(tokenizer: Any) -> tuple[str, int] | None:
    """An added token that is cut out of any text exactly as written and leaves its neighbours alone
    (no rstrip, not matched on normalized text, not single-word): text after it encodes as text after
    a token. None when the tokenizer has none."""
    tokens = sorted((getattr(tokenizer, "added_tokens_decoder", None) or {}).items())
    for tid, token in tokens:
        if token.rstrip or token.normalized or token.single_word:
            continue
        if not any(o.content != token.content and o.content.startswith(token.content) for _, o in tokens):
            return token.content, tid
    return None


def tool_dicts(tools: list[ToolSpec] | None) -> list[JSONDict] | None:
    """Tools as the plain OpenAI dicts templates expect (``{"type": "function", "function": {...}}``)."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """eos plus every known end-of-turn token that is in the vocabulary."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    vocab = tokenizer.get_vocab()
    for text in END_OF_TURN_TOKENS:
        tid = vocab.get(text)
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids
