"""One trajectory as ``agentloop inspect`` prints it: the call tree, then each sample's tokens in colour."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop.commands.inspect_store import InspectError, run_config
from agentloop.commands.inspect_text import printable
from agentloop.types import Triplet

DIM, GREEN, YELLOW, BOLD, RESET = "\x1b[2m", "\x1b[32m", "\x1b[33m", "\x1b[1m", "\x1b[0m"


def call_tree(calls: list[Triplet], advantages: list[float | None]) -> list[str]:
    """One line per call of an attempt (``calls`` in time order, from ``spans_to_triplets``; ``advantages``
    beside them), each under the call it extends: the first call extending a call stays at its level (the
    same sample), a fork goes one step in. Branch names and ids come from the triplets' metadata."""
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    position: dict[Any, int] = {}  # call_id -> the latest call with it
    for k, t in enumerate(calls):
        parent = position.get(t.metadata.get("parent_call_id"))
        (roots if parent is None else children.setdefault(parent, [])).append(k)
        position[t.metadata.get("call_id")] = k
    lines: list[str] = []
    stack = [(k, 0, False) for k in reversed(roots)]
    while stack:  # depth first, children in time order
        k, depth, fork = stack.pop()
        t, m = calls[k], calls[k].metadata
        extends = f" <- #{m['parent_call_id']}" if m.get("parent_call_id") is not None else ""
        own, advantage = m.get("call_reward"), advantages[k] if k < len(advantages) else None
        lines.append(
            printable(
                f"{'  ' * depth}#{m.get('call_id', k + 1)} {m.get('branch') or '?'}{extends}"
                f"{' (fork)' if fork else ''}: prompt {len(t.prompt_ids)}, response {len(t.response_ids)} "
                f"tokens; reward {'-' if own is None else f'{own:.3f}'}"
                + ("" if advantage is None else f"; advantage {advantage:+.3f}")
            )
        )
        kids = children.get(k, [])
        stack.extend((c, depth + (j > 0), j > 0) for j, c in reversed(list(enumerate(kids))))
    return lines


def render(tokenizer: Any, triplet: Triplet, color: bool) -> str:
    """Prompt dim; response tokens green where mask 1 (model) and yellow where mask 0 (not trained);
    the text is ``printable``."""
    out = [_paint(tokenizer.decode(triplet.prompt_ids), DIM, "prompt", color)]
    mask = triplet.response_mask or []
    start = 0
    for i in range(1, len(mask) + 1):  # runs of equal mask values
        if i == len(mask) or mask[i] != mask[start]:
            text = tokenizer.decode(triplet.response_ids[start:i])
            out.append(
                _paint(text, GREEN, "model", color) if mask[start] else _paint(text, YELLOW, "masked", color)
            )
            start = i
    return "".join(out)


def _paint(text: str, code: str, tag: str, color: bool) -> str:
    text = printable(text)
    return f"{code}{text}{RESET}" if color else f"[{tag}]{text}[/{tag}]"


def print_trajectory(
    w: Callable[[str], Any],
    title: str,
    per_call: list[Triplet],
    triplets: list[Triplet],
    advantages: list[float | None],
    tokenizer: Any,
    color: bool,
) -> None:
    """The call tree of ``per_call`` (one triplet a call), then each sample (``triplets``) in colour."""
    w(
        f"\n{BOLD if color else ''}trajectory of {title}{RESET if color else ''} "
        f"({len(triplets)} sample(s); green: model tokens, trained; yellow: masked)\n"
    )
    if len(per_call) > 1:
        w("calls (each under the call it extends; a fork one step in):\n")
        w("".join(f"  {line}\n" for line in call_tree(per_call, advantages)))
    for number, t in enumerate(triplets, 1):
        sources = [int(c["source"]) for c in t.metadata.get("calls", [])]  # its calls' places in per_call
        if len(triplets) > 1:
            ids = " ".join(f"#{per_call[k].metadata.get('call_id', k + 1)}" for k in sources)
            w(printable(f"sample {number}/{len(triplets)}: {t.metadata.get('branch') or '?'}, calls {ids}\n"))
        shown = ", ".join("-" if advantages[k] is None else f"{advantages[k]:+.3f}" for k in sources)
        w(render(tokenizer, t, color) + f"\n  -> reward {t.reward}; advantage per call: {shown}\n")


def load_tokenizer(run_dir: Path, model: str | None = None, named_by: str | None = None) -> Any:
    """The tokenizer ``model`` names (the user's ``--model``: may be downloaded), else the one the run's
    files name (``named_by``, or the run's config.json): a local folder only, never a download."""
    from transformers import AutoTokenizer

    from agentloop.engine.models import ModelResolutionError, resolve_model

    if model is None or named_by is not None:
        if model is None:
            config = run_config(run_dir)
            model = config.get("actor_rollout_ref", {}).get("model", {}).get("path", "smollm2-135m-instruct")
            named_by = str(run_dir / "config.json")
        try:
            path = resolve_model(str(model), download=False)
        except ModelResolutionError as exc:
            raise InspectError(
                f"{named_by} names the model {printable(str(model))[:200]!r}: {printable(str(exc))[:300]}. "
                "inspect loads only local folders that a run's files name; pass --model with a local "
                "folder (or a hub id you trust)"
            ) from None
    else:
        path = resolve_model(model)
    return AutoTokenizer.from_pretrained(str(path))
