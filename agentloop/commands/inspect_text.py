"""Text read from a run's files made safe to print: control characters and escape sequences escaped (``printable``)."""

from __future__ import annotations

# C0 controls but newline and tab, DEL, C1 controls (U+0080-U+009F: 8-bit CSI and friends), and the
# bidirectional overrides that make text display in another order than it reads ("trojan source").
_UNPRINTABLE = [c for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)]
_UNPRINTABLE += [0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPED = str.maketrans({c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNPRINTABLE})


def printable(text: str) -> str:
    """``text`` with control characters and escape sequences written as ``\\x1b`` / ``\\u202e``."""
    return text.translate(_ESCAPED)
