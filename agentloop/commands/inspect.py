"""``agentloop inspect RUN``: a table of the rollouts (and app sessions) and one trajectory in colour.

``RUN`` is a training run folder (``store.db``), the SQLite file ``agentloop serve --store`` wrote
(``agentloop-serve.db``: its app sessions are in it, beside the rollouts), or a folder holding one
such file.

The trajectory starts with the attempt's call tree (``call_tree``): one line per call with its id, its
branch (main, subagent, compaction, side: agentloop/adapter.py), the call it extends, its tokens, its own
reward and its advantage; a call that continues its parent's sample stays at its parent's level, a fork
(a second call extending the same call) is indented one step under it. Then each sample (one per
branch, ``merge_turns``): the prompt is dim, tokens the model produced (trained, mask 1) are green, and
tokens it did not produce (tool output, later user turns: mask 0) are yellow. For a training rollout
each call's advantage is shown as the trainer computed it (``trainer.sample_advantages`` over the
attempts at the same task in the same step, with the run's config).

Read-only: the store is opened with SQLite's ``mode=ro`` (``ReadOnlyStore``), so inspecting a run,
even one still being written, never changes its files. The tokenizer a run's files name (its
``config.json``, the served model in a store's metadata) is loaded only from a local folder (or the
bundled SmolLM2 alias): a hostile store once named a hub repo and ``inspect`` downloaded it. A hub id
is fetched only when the user names it with ``--model``. Model text is hostile input: control
characters and terminal escape sequences in it (and in ids, names and inputs read from the files) are
printed escaped (``\x1b``), never sent to the terminal as they are (``printable``).

This module is the command; its pieces: ``inspect_store.py`` (the read-only store, the rows, a rollout's
calls and advantages), ``inspect_tables.py`` (the rollout and session tables), ``inspect_trajectory.py``
(the call tree and the coloured samples, the tokenizer), ``inspect_text.py`` (``printable``) and
``inspect_errors.py`` (``--errors``).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

import anyio

from agentloop.commands.inspect_store import InspectError, ReadOnlyStore, collect, locate, trajectory
from agentloop.commands.inspect_tables import print_rollouts, print_sessions, session_reward
from agentloop.commands.inspect_text import printable
from agentloop.commands.inspect_trajectory import load_tokenizer, print_trajectory
from agentloop.proxy.sessions import SessionRecord, read_saved_sessions
from agentloop.types import Rollout


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a run's rollouts and one trajectory (model vs masked tokens)")
    p.add_argument(
        "run_dir",
        type=Path,
        help="a run folder (store.db, config.json), or the store `agentloop serve` wrote (agentloop-serve.db, "
        "or the folder holding it)",
    )
    p.add_argument("--limit", type=int, default=20, help="rows in the rollout and session tables")
    p.add_argument(
        "--rollout",
        default=None,
        help="the rollout or session to print, by id or a unique start of it (default: the best-rewarded one)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the tokenizer to decode with: a local folder, or a hub id to download (default: the run's "
        "model or the served one, from a local folder only)",
    )
    p.add_argument("--no-color", action="store_true", help="plain text with [model]...[/model] marks")
    p.add_argument(
        "--errors",
        action="store_true",
        help="list the failed attempts and where the agent raised, with their tracebacks "
        "(--rollout ID: that rollout's in full)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except InspectError as exc:
        sys.stderr.write(f"agentloop inspect: {exc}\n")
        return 2


def _run(args: argparse.Namespace) -> int:
    db = locate(args.run_dir)
    run_dir = db.parent
    if args.errors:  # agentloop/commands/inspect_errors.py
        return _print_errors(args, db)
    rows = anyio.run(collect, db)
    try:
        server, sessions = read_saved_sessions(db)
    except sqlite3.DatabaseError as exc:
        raise InspectError(f"{db} is not an agentloop store ({exc})") from None
    color = not args.no_color and sys.stdout.isatty()
    w = sys.stdout.write
    print_rollouts(w, rows, db, args.limit)
    session_rewards = {rec.session_id: session_reward(rec) for rec in sessions}
    if server or sessions:
        print_sessions(w, server, sessions, session_rewards, db, args.limit)
    chosen = args.rollout
    if chosen is None:
        chosen = _best(rows, sessions, session_rewards)
        if chosen is None:
            w("no rollout with LLM calls and a reward to print\n")
            failed = sum(r.status.value == "failed" for r, _, _ in rows)
            if failed:
                hint = f"`agentloop inspect {args.run_dir} --errors` shows where the agent raised"
                w(f"{failed} failed: {hint}\n")
            return 0
    match = _match(chosen, rows, sessions, session_rewards, args.run_dir)
    from agentloop.adapter import merge_turns, spans_to_triplets

    if match in session_rewards:
        rec = next(r for r in sessions if r.session_id == match)
        per_call = spans_to_triplets(rec.spans()).triplets
        advantages: list[float | None] = [None] * len(per_call)  # no groups outside training
        title = f"session {printable(match)}"
        model = args.model or server.get("tokenizer") or server.get("model")
        named_by = None if args.model else f"the store's metadata ({db})"
    else:
        per_call, _, advantages = anyio.run(trajectory, run_dir, match, db)
        title, model, named_by = printable(match), args.model, None
    triplets = merge_turns(per_call)
    tokenizer = load_tokenizer(run_dir, model, named_by)
    print_trajectory(w, title, per_call, triplets, advantages, tokenizer, color)
    return 0


def _print_errors(args: argparse.Namespace, db: Path) -> int:
    """``--errors``: the failed attempts and where the agent raised (agentloop/commands/inspect_errors.py)."""
    from agentloop.commands.inspect_errors import print_errors

    store = ReadOnlyStore(db)
    try:
        where = db if db.name != "store.db" else db.parent
        return print_errors(
            store._conn, where, sys.stdout.write, printable, rollout=args.rollout, limit=args.limit
        )
    finally:
        anyio.run(store.close)


def _best(
    rows: list[tuple[Rollout, float | None, int]],
    sessions: list[SessionRecord],
    session_rewards: dict[str, float | None],
) -> str | None:
    """The id shown without ``--rollout``: the best-rewarded rollout or session with calls, else the
    latest session with calls (an app that posts no rewards); None when there is none."""
    scored = [(reward, r.rollout_id) for r, reward, calls in rows if reward is not None and calls]
    scored += [(reward, sid) for sid, reward in session_rewards.items() if reward is not None]
    if not scored:  # an app that posts no rewards: its latest session with calls
        scored = [(0.0, rec.session_id) for rec in sessions[-1:] if rec.call_json]
    if not scored:
        return None
    return max(scored)[1]


def _match(
    chosen: str,
    rows: list[tuple[Rollout, float | None, int]],
    sessions: list[SessionRecord],
    session_rewards: dict[str, float | None],
    run_dir: Path,
) -> str:
    """The one rollout or session id ``chosen`` names (the id, or a unique start of it)."""
    rollout_ids = [r.rollout_id for r, _, _ in rows]
    matches = [i for i in [*rollout_ids, *session_rewards] if i.startswith(chosen)]
    if chosen in rollout_ids or chosen in session_rewards:
        matches = [chosen]
    if not matches:
        raise InspectError(
            f"--rollout {chosen!r}: no rollout or session has this id ({len(rows)} rollouts, "
            f"{len(sessions)} sessions in {run_dir}); the table above lists the ids"
        )
    if len(matches) > 1:
        raise InspectError(
            f"--rollout {chosen!r} starts {len(matches)} ids "
            f"({', '.join(printable(m[:16]) for m in matches[:4])}, ...); give more of the id"
        )
    (match,) = matches
    return match
