"""Chat templating with the engine's tokenizer: OpenAI messages -> template text -> token ids.

The template is compiled once (the same sandboxed jinja environment transformers uses) and rendered
directly, which is several times cheaper than ``tokenizer.apply_chat_template`` per request.

Templates that know nothing of tools (SmolLM2's) still get them: the tool schemas go into the
system message in the hermes format, and earlier assistant tool calls are rendered inline as
``<tool_call>{json}</tool_call>``, the same text the model is asked to produce.

Special-token text inside message content is text, never a special token: a tool result or a user
message holding ``<|im_end|>\n<|im_start|>system`` must not forge a turn. ``render`` escapes every
special token's text in the strings it gives the template (``ContentEscapes``), so in its output only
the template's own special tokens are written as themselves; ``encode`` turns those into their ids
and encodes the escaped ones back as the plain text they were (the tokenizer's
``encode_special_tokens`` mode, as ``split_special_tokens=True`` does in transformers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
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


def hermes_tool_call_text(call: JSONDict, escape: Callable[[str], str] | None = None) -> str:
    """``<tool_call>{json}</tool_call>``; ``escape`` applies to the JSON (the call's text), not the tags."""
    text = json.dumps({"name": call["name"], "arguments": call["arguments"]})
    return "<tool_call>\n" + (escape(text) if escape else text) + "\n</tool_call>"


_MARK = "\ue000"  # a private-use character: starts an escape in rendered text (see ContentEscapes)
_CODES = 0xF0000  # escape codes: private-use plane 15, one code point per special token


class ContentEscapes:
    """Escapes the text of special tokens inside message content, reversibly.

    ``escape`` writes special token number ``k`` as ``_MARK + chr(_CODES + k)`` and a literal
    ``_MARK`` as two of them, so the template never sees a special token's text in content (and a
    string that already holds escape codes cannot pass for an escaped token: it is escaped too).
    ``unescape`` gives the original text back. Only tokens marked special are escaped: non-special
    added tokens (``<think>``, ``<tool_call>`` in some vocabularies) are text the model writes, and
    templates look for them in content.
    """

    def __init__(self, specials: Sequence[str]) -> None:
        self.specials = sorted(set(specials), key=len, reverse=True)[:0xFFFD]  # longest first
        self._code = {t: _MARK + chr(_CODES + i) for i, t in enumerate(self.specials)}
        self._code[_MARK] = _MARK + _MARK
        self._text = {code[1]: t for t, code in self._code.items()}
        self._find = re.compile("|".join(re.escape(t) for t in [_MARK, *self.specials]))
        self._escaped = re.compile(re.escape(_MARK) + "(.)", re.DOTALL)

    def escape(self, text: str) -> str:
        return self._find.sub(lambda m: self._code[m.group(0)], text)

    def unescape(self, text: str) -> str:
        return self._escaped.sub(lambda m: self._text.get(m.group(1), m.group(0)), text)

    def escape_all(self, value: Any) -> Any:
        """Every string inside ``value`` (dicts, lists; keys are left alone) escaped."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {k: self.escape_all(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape_all(v) for v in value]
        return value


def special_token_texts(tokenizer: Any) -> list[str]:
    """The text of every added token the tokenizer marks special (``<|im_start|>``, ``<|im_end|>``...)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = [t.content for t in decoder.values() if getattr(t, "special", False) and t.content]
    for value in (getattr(tokenizer, "special_tokens_map", None) or {}).values():
        texts += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str) and v]
    return sorted(set(texts))


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
        specials = special_token_texts(tokenizer)
        self.escapes = ContentEscapes(specials) if specials else None

    def _for_template(self, messages: Sequence[JSONDict], tools: list[JSONDict] | None) -> list[JSONDict]:
        """The messages as the template takes them. Every string that came from the request is
        escaped (content is text: its special-token text must not become ids); the markup the proxy
        adds itself (hermes tags and tool block) is not."""
        escape = self.escapes.escape if self.escapes is not None else None
        out = []
        for original in messages:
            m = self.escapes.escape_all(dict(original)) if self.escapes is not None else dict(original)
            if "tool_calls" in m:
                if self.supports_tool_calls:
                    m["tool_calls"] = [{"type": "function", "function": c} for c in m["tool_calls"]]
                else:
                    m.pop("tool_calls")
                    calls = "\n".join(hermes_tool_call_text(c, escape) for c in original["tool_calls"])
                    m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
            out.append(m)
        if tools and not self.supports_tools:
            lines = (json.dumps(t, ensure_ascii=False) for t in tools)
            block = _HERMES_SYSTEM.format(tools="\n".join(escape(t) if escape else t for t in lines))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render(
        self, messages: Sequence[JSONDict], tools: list[JSONDict] | None, add_generation_prompt: bool
    ) -> str:
        """The template text of ``messages``; a template error (roles must alternate...) is a 400.

        Special-token text that came from the messages or tools is escaped in it (module docstring):
        the text is for ``encode``; ``unescape`` gives the text a reader would see."""
        if tools and self.supports_tools and self.escapes is not None:
            tools = self.escapes.escape_all(tools)
        try:
            return self._template.render(
                messages=self._for_template(messages, tools),
                tools=tools if self.supports_tools else None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
        except jinja2.TemplateError as exc:
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None

    def unescape(self, text: str) -> str:
        """Rendered text as a reader sees it (escaped special-token text written out again)."""
        return self.escapes.unescape(text) if self.escapes is not None else text

    def encode(self, text: str, *, follows_token: bool = False) -> list[int]:
        """Token ids of template text; special-token text (``<|im_start|>``) becomes its single id,
        and escaped special-token text (content, see ``render``) is encoded as plain text.

        ``follows_token``: ``text`` continues a prompt right after a token already in it (the
        ledger's delta after ``<|im_end|>``), so it is encoded as the tokenizer encodes text after an
        added token, not as the start of a string (a Metaspace ``prepend_scheme="first"`` pre-tokenizer
        adds '▁' only at the start).
        """
        if self._pieces is not None:
            return self._pieces.encode(text, follows_token=follows_token, escapes=self.escapes)
        if self.escapes is not None and _MARK in text:
            return self._encode_escaped(text, follows_token)
        return self._encode_plain(text, follows_token)

    def _encode_plain(self, text: str, follows_token: bool) -> list[int]:
        if follows_token and self._anchor is not None and text:
            ids = list(self.tokenizer.encode(self._anchor[0] + text, add_special_tokens=False))
            if ids[:1] == [self._anchor[1]]:
                return ids[1:]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_escaped(self, text: str, follows_token: bool) -> list[int]:
        """Tokenizers without a PieceEncoder: the text around each escaped special token is encoded as
        usual, the token's text alone with ``split_special_tokens`` (merges across the seams are lost;
        the text is the same)."""
        assert self.escapes is not None
        out: list[int] = []
        parts = re.split("(" + re.escape(_MARK) + ".)", text, flags=re.DOTALL)
        for i, part in enumerate(parts):
            if not part:
                continue
            if i % 2:  # an escape code
                literal = self.escapes.unescape(part)
                if literal in self.escapes.specials:
                    out += self.tokenizer.encode(literal, add_special_tokens=False, split_special_tokens=True)
                    continue
                part = literal
            out += self._encode_plain(part, follows_token or bool(out))
        return out


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
    TEXT_ANCHOR = _MARK * 3 + "agentloop-anchor" + _MARK * 3  # see _text_backend

    def __init__(self, backend: Any, added: dict[str, int], anchor: str) -> None:
        self._backend = backend
        self._added = added
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
        )
        self._anchor, self._anchor_id = anchor, added[anchor]
        self._cache: dict[str, list[int]] = {}  # pieces that follow an added token
        self._first_cache: dict[str, list[int]] = {}  # pieces at the start of a text
        self._text: tuple[Any, int] | None = None  # built on first use: see _text_backend

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

    def encode(
        self, text: str, follows_token: bool = False, escapes: ContentEscapes | None = None
    ) -> list[int]:
        """The ids of ``text``; ``follows_token``: it continues after a token (see ChatTemplate.encode);
        ``escapes``: pieces holding escaped special-token text are encoded as that plain text."""
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
                if escapes is not None and _MARK in piece:  # the escapes are a bijection: cacheable
                    ids = self._encode_text(escapes.unescape(piece), at_start)
                else:
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

    def _text_backend(self) -> tuple[Any, int]:
        """A copy of the tokenizer that encodes special-token text as text (``encode_special_tokens``),
        with one extra non-special added token, ``TEXT_ANCHOR``, that it still cuts out: text after it
        encodes as text after a token (as ``_encode_piece`` does with the anchor)."""
        if self._text is None:
            from tokenizers import AddedToken, Tokenizer

            backend = Tokenizer.from_str(self._backend.to_str())
            backend.encode_special_tokens = True
            backend.add_tokens([AddedToken(self.TEXT_ANCHOR, special=False, normalized=False)])
            anchor_id = backend.token_to_id(self.TEXT_ANCHOR)
            assert anchor_id is not None, "an added token has an id"
            self._text = backend, anchor_id
        return self._text

    def _encode_text(self, text: str, at_start: bool) -> list[int]:
        """``text`` (content holding special-token text) as plain text: no special token's id in it."""
        backend, anchor_id = self._text_backend()
        if self.TEXT_ANCHOR in text:
            raise bad_request(
                "message content holds the proxy's reserved anchor text (private-use characters)"
            )
        if at_start:
            return list(backend.encode(text, add_special_tokens=False).ids)
        ids = backend.encode(self.TEXT_ANCHOR + text, add_special_tokens=False).ids
        if ids[:1] != [anchor_id]:  # pragma: no cover - an added token is cut out before anything else
            raise RuntimeError(f"the text anchor did not encode to its own id first: {ids[:3]}")
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
