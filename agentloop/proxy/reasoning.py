"""The model's own reasoning (``<think>...</think>``) as a Responses ``reasoning`` item or an Anthropic
``thinking`` block, and back, without losing a character.

A reasoning model writes its thoughts into the same text as its answer. The Responses API returns them
as a separate ``reasoning`` item and the Messages API as a ``thinking`` block; clients (Codex CLI,
Claude Code) send those back in the next request, and the token ledger (ledger.py) extends an earlier
call only when the assistant turn comes back exactly as the model wrote it. So the exact text of the
thought (tags and the whitespace after them included) travels in the item's opaque field
(``encrypted_content``, a thinking block's ``signature``) as ``agentloop-reasoning-v1:<base64url>``,
and ``raw_reasoning`` reads it back: the assistant turn is then the thought + the answer's text,
character for character. It is an encoding, not a secret (the client could send any assistant text
anyway). A reasoning item or thinking block without it (another server's, or edited) is skipped; the
turn then differs from what the model wrote and the ledger says so (``ledger_break``).
"""

from __future__ import annotations

import base64
import binascii

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PREFIX = "agentloop-reasoning-v1:"


def split_reasoning(content: str | None) -> tuple[str, str]:
    """``(raw thought, answer text)`` with ``raw + text == content``; raw is "" when there is none.

    A thought opens the content with ``<think>`` (leading whitespace allowed), or the template opened
    it in the prompt and the content holds only its ``</think>``; it ends after ``</think>`` and the
    whitespace that follows. An unclosed thought (the token limit cut it) is all thought.
    """
    text = content or ""
    close = text.find(THINK_CLOSE)
    opened = text.lstrip().startswith(THINK_OPEN)
    if not opened and (close < 0 or THINK_OPEN in text[:close]):
        return "", text
    if close < 0:
        return text, ""
    end = close + len(THINK_CLOSE)
    end += len(text[end:]) - len(text[end:].lstrip())
    return text[:end], text[end:]


def reasoning_text(raw: str) -> str:
    """What a reader sees of a raw thought: without its tags and surrounding whitespace."""
    text = raw.strip()
    text = text.removeprefix(THINK_OPEN)
    return text.removesuffix(THINK_CLOSE).strip() if text.endswith(THINK_CLOSE) else text.strip()


def encode_reasoning(raw: str) -> str:
    """The opaque form of a raw thought (module docstring)."""
    return _PREFIX + base64.urlsafe_b64encode(raw.encode()).decode()


def raw_reasoning(opaque: object) -> str | None:
    """The raw thought ``encode_reasoning`` wrote into ``opaque``; None when it is not one of ours."""
    if not isinstance(opaque, str) or not opaque.startswith(_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(opaque[len(_PREFIX) :].encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
