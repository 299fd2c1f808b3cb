"""JSON Schema's regular expressions (``pattern``, ``patternProperties``) with a time budget, for the
schemas an MCP server sends (hostile input, like the model's arguments they check).

Why: ``jsonschema`` matches with the stdlib ``re``, which backtracks without bound and holds the GIL
while it does, so a server's ``"pattern": "^(a|a)*$"`` against 25 characters of model output stalled
the event loop for seconds (doubling with each character), and a thread does not help. Here every match
goes through the ``regex`` package with ``timeout=`` (what is left of the check's budget) and
``concurrent=True`` (it releases the GIL while matching), and a match that runs out of time is a
validation error. The budget is set per check with :func:`budget`; outside one, each match gets
``DEFAULT_BUDGET_S``.

Traps: ``regex``'s timeout counts CPU time, so on a loaded machine a match may take a few times its
budget in wall time (bounded all the same, and off the event loop when the check runs in a thread).
``unevaluatedProperties`` next to ``patternProperties`` matches keys inside ``jsonschema`` with ``re``
(no keyword to replace): :func:`refuse_unbounded` refuses such a schema when the tool is defined.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError

__all__ = ["DEFAULT_BUDGET_S", "budget", "extend", "refuse_unbounded"]

DEFAULT_BUDGET_S = 1.0  # regex time for one check of one call's arguments; legitimate ones take microseconds

# When the check in progress must end (time.monotonic()); None: no check in progress.
_deadline: ContextVar[float | None] = ContextVar("agentloop_pattern_deadline", default=None)


class _TooSlow(Exception):
    pass


@contextmanager
def budget(seconds: float = DEFAULT_BUDGET_S) -> Iterator[None]:
    """All the matches inside the block share ``seconds`` of regex time."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def _search(pattern: str, text: str) -> bool:
    deadline = _deadline.get()
    left = DEFAULT_BUDGET_S if deadline is None else deadline - time.monotonic()
    if left <= 0:
        raise _TooSlow
    try:
        return regex.search(pattern, text, timeout=left, concurrent=True) is not None
    except TimeoutError:
        raise _TooSlow from None


def _too_slow(pattern: str, what: str) -> ValidationError:
    return ValidationError(
        f"checking {what} against the schema's pattern {pattern!r} ran past its time budget "
        "(a backtracking pattern?); refused"
    )


def _unusable(pattern: str, exc: regex.error) -> ValidationError:
    return ValidationError(f"the schema's pattern {pattern!r} cannot be used ({exc})")


def _pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    try:
        if not _search(patrn, instance):
            yield ValidationError(f"{instance[:80]!r} does not match {patrn!r}")
    except _TooSlow:
        yield _too_slow(patrn, "the value")
    except regex.error as exc:
        yield _unusable(patrn, exc)


def _key_matches(pattern: str, key: str) -> bool | ValidationError:
    try:
        return _search(pattern, key)
    except _TooSlow:
        return _too_slow(pattern, f"the property name {key[:80]!r}")
    except regex.error as exc:
        return _unusable(pattern, exc)


def _pattern_properties(
    validator: Any, pattern_properties: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for key, value in instance.items():
            found = _key_matches(pattern, key)
            if isinstance(found, ValidationError):
                yield found
            elif found:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, ap: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """jsonschema's ``additionalProperties``, its key matching bounded."""
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras: list[str] = []
    for key in instance:
        if key in properties:
            continue
        matched = False
        for pattern in patterns:
            found = _key_matches(pattern, key)
            if isinstance(found, ValidationError):
                yield found
                return
            if found:
                matched = True
                break
        if not matched:
            extras.append(key)
    if validator.is_type(ap, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], ap, path=extra)
    elif not ap and extras:
        names = ", ".join(repr(e) for e in sorted(extras))
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            yield ValidationError(
                f"{names} {verb} not match any of the regexes: {', '.join(map(repr, sorted(patterns)))}"
            )
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({names} {verb} unexpected)")


@functools.cache
def extend(cls: Any) -> Any:
    """``cls`` (a jsonschema validator class) with its regex keywords bounded."""
    return jsonschema.validators.extend(
        cls,
        {
            "pattern": _pattern,
            "patternProperties": _pattern_properties,
            "additionalProperties": _additional_properties,
        },
    )


def refuse_unbounded(schema: Any) -> str | None:
    """Why ``schema`` cannot be checked within a budget, or None (see the module's traps)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.update(k for k in ("unevaluatedProperties", "patternProperties") if k in node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    if {"unevaluatedProperties", "patternProperties"} <= found:
        return (
            "it uses unevaluatedProperties together with patternProperties, whose key matching "
            "cannot be bounded in time"
        )
    return None
