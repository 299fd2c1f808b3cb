"""The base of every config section and the helpers that walk sections by key: the class of a
field's section, the valid key a wrong one most likely meant, a location as a dotted key."""

from __future__ import annotations

import difflib
from typing import get_args

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _submodel(model: type[BaseModel] | None, key: str | int) -> type[BaseModel] | None:
    """The pydantic model class of field ``key`` in ``model`` (None when it is not a section)."""
    if model is None or not isinstance(key, str) or key not in model.model_fields:
        return None
    ann = model.model_fields[key].annotation
    inner = [a for a in get_args(ann) if a is not type(None)]
    if len(inner) == 1 and len(get_args(ann)) == 2:  # an optional section, `X | None`: X
        ann = inner[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _closest(name: str, valid: list[str]) -> list[str]:
    """The valid name that ``name`` most likely meant: an abbreviation (learning_rate -> lr), else difflib."""
    initials = "".join(w[0] for w in name.split("_") if w)
    abbrev = [v for v in valid if len(name.split("_")) > 1 and v == initials]
    return abbrev or difflib.get_close_matches(name, valid, n=1, cutoff=0.6)


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
