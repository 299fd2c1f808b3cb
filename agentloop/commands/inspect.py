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
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from agentloop.proxy.sessions import SessionRecord, read_saved_sessions
from agentloop.types import Reward, Rollout, Span, Triplet

DIM, GREEN, YELLOW, BOLD, RESET = "\x1b[2m", "\x1b[32m", "\x1b[33m", "\x1b[1m", "\x1b[0m"

# C0 controls but newline and tab, DEL, C1 controls (U+0080-U+009F: 8-bit CSI and friends), and the
# bidirectional overrides that make text display in another order than it reads ("trojan source").
_UNPRINTABLE = [c for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)]
_UNPRINTABLE += [0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPED = str.maketrans({c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNPRINTABLE})


def printable(text: str) -> str:
    """``text`` with control characters and escape sequences written as ``\\x1b`` / ``\\u202e``."""
    return text.translate(_ESCAPED)


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


class InspectError(Exception):
    """A path or id that ``inspect`` cannot use; the message says what to give instead."""


def locate(path: Path) -> Path:
    """The SQLite store that ``path`` names: the file itself, or the one store in the folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise InspectError(f"{path} does not exist; give a run folder or the store `agentloop serve` wrote")
    if (path / "store.db").is_file():
        return path / "store.db"
    dbs = sorted(path.glob("*.db"))
    if len(dbs) > 1:
        names = ", ".join(d.name for d in dbs)
        raise InspectError(f"{path} holds several stores ({names}); give one of them")
    if dbs:
        return dbs[0]
    raise InspectError(
        f"{path} has no store.db; give a run folder written by training, or the store file "
        "`agentloop serve` wrote (agentloop-serve.db by default, in the folder it ran in)"
    )


def _trained(rec: SessionRecord) -> str:
    """What an online update did with a session: ``v2 (update 3)``, ``rejected (update 4)``, ``-``."""
    t = rec.trained
    if t is None:
        return "-"
    return f"{f'v{t.version}' if t.outcome == 'promoted' else t.outcome} (update {t.update})"


def _session_reward(rec: SessionRecord) -> float | None:
    return rec.total_reward


def _reward(spans: list[Any]) -> float | None:
    values = [s.payload.value for s in spans if isinstance(s.payload, Reward)]
    return sum(values) if values else None


class ReadOnlyStore:
    """The reads ``inspect`` makes, on a read-only connection to the file ``SQLiteStore`` writes
    (``mode=ro``: opening a ``SQLiteStore`` sets the journal mode and creates its tables, both writes).
    Reads the tables ``agentloop/store/sqlite.py`` defines: rollouts (with their latest attempt) and spans.
    """

    def __init__(self, path: Path) -> None:
        uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
        try:
            try:
                self._conn = self._open(uri)
            except sqlite3.OperationalError:  # a WAL store on read-only media: no -shm can be made there
                self._conn = self._open(uri + "&immutable=1")
        except sqlite3.Error as exc:
            raise InspectError(f"{path} cannot be read as an agentloop store: {exc}") from None

    @staticmethod
    def _open(uri: str) -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True)
        try:
            conn.execute("SELECT 1 FROM rollouts LIMIT 1")
        except sqlite3.Error:
            conn.close()
            raise
        return conn

    async def list_rollouts(self) -> list[Rollout]:
        rows = self._conn.execute("SELECT data FROM rollouts ORDER BY seq")
        return [Rollout.model_validate_json(r[0]) for r in rows]

    async def get_rollout(self, rollout_id: str) -> Rollout:
        row = self._conn.execute("SELECT data FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        if row is None:
            raise InspectError(f"no rollout {printable(rollout_id)!r} in the store")
        return Rollout.model_validate_json(row[0])

    async def query_spans(self, rollout_id: str, attempt_id: str = "latest") -> list[Span]:
        """The spans of the rollout's latest attempt (``attempt_id`` other than "latest": that one)."""
        if attempt_id == "latest":
            row = self._conn.execute(
                "SELECT latest_attempt_id FROM rollouts WHERE rollout_id=?", (rollout_id,)
            ).fetchone()
            if row is None or row[0] is None:
                return []
            attempt_id = row[0]
        rows = self._conn.execute(
            "SELECT data FROM spans WHERE attempt_id=? ORDER BY sequence_id", (attempt_id,)
        )
        return [Span.model_validate_json(r[0]) for r in rows]

    async def close(self) -> None:
        self._conn.close()


async def collect(db: Path) -> list[tuple[Rollout, float | None, int]]:
    store = ReadOnlyStore(db)
    try:
        rows = []
        for rollout in await store.list_rollouts():
            spans = await store.query_spans(rollout.rollout_id) if rollout.num_attempts else []
            calls = sum(1 for s in spans if s.kind == "llm_call")
            rows.append((rollout, _reward(spans), calls))
        return rows
    finally:
        await store.close()


async def trajectory(
    run_dir: Path, rollout_id: str, db: Path | None = None
) -> tuple[list[Triplet], Rollout, list[float | None]]:
    """The rollout's calls (one triplet each, in time order), the rollout, and each call's advantage (None
    when the trainer would not train on it, or the rollout is not a training rollout)."""
    from agentloop.adapter import spans_to_triplets, triplets_for_rollouts
    from agentloop.types import RolloutStatus
    from trainer import TrainerConfig, sample_advantages  # the CLI is where agentloop reaches the trainer

    config = _config(run_dir)
    store = ReadOnlyStore(db if db is not None else run_dir / "store.db")
    try:
        rollout = await store.get_rollout(rollout_id)
        spans = await store.query_spans(rollout_id)
        calls = spans_to_triplets(spans, rollout=rollout).triplets
        advantages: list[float | None] = [None] * len(calls)
        if rollout.mode == "train" and rollout.status is RolloutStatus.SUCCEEDED:
            key = (rollout.metadata.get("step"), rollout.metadata.get("data_index"))
            group = [
                r.rollout_id
                for r in await store.list_rollouts()
                if r.mode == "train" and (r.metadata.get("step"), r.metadata.get("data_index")) == key
            ]
            cfg = TrainerConfig.from_dict(config)
            adapted = await triplets_for_rollouts(store, group, cfg.adapter.credit_assignment)  # type: ignore[arg-type]
            if not cfg.algorithm.use_kl_in_reward:
                by_call = dict(
                    zip(
                        (
                            (t.metadata.get("attempt_id"), t.metadata.get("call_index"))
                            for t in adapted.triplets
                        ),
                        sample_advantages(adapted.triplets, cfg),
                        strict=True,
                    )
                )
                advantages = [
                    by_call.get((t.metadata.get("attempt_id"), t.metadata.get("call_index"))) for t in calls
                ]
    finally:
        await store.close()
    return calls, rollout, advantages


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
    _print_rollouts(w, rows, db, args.limit)
    session_rewards = {rec.session_id: _session_reward(rec) for rec in sessions}
    if server or sessions:
        _print_sessions(w, server, sessions, session_rewards, db, args.limit)
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
    tokenizer = _tokenizer(run_dir, model, named_by)
    _print_trajectory(w, title, per_call, triplets, advantages, tokenizer, color)
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


def _print_rollouts(
    w: Callable[[str], Any], rows: list[tuple[Rollout, float | None, int]], db: Path, limit: int
) -> None:
    """The rollout table: the last ``limit`` rows."""
    w(f"{len(rows)} rollouts in {db if db.name != 'store.db' else db.parent}\n")
    w(f"{'rollout':<14} {'mode':<5} {'status':<10} {'attempts':>8} {'calls':>5} {'reward':>7}  input\n")
    for rollout, reward, calls in rows[-limit:]:
        shown = json.dumps(rollout.input)[:60]
        r = "-" if reward is None else f"{reward:.3f}"
        rid = printable(rollout.rollout_id[:13])
        w(
            f"{rid:<14} {rollout.mode:<5} {rollout.status.value:<10} {rollout.num_attempts:>8} {calls:>5} {r:>7}  {shown}\n"
        )


def _print_sessions(
    w: Callable[[str], Any],
    server: dict[str, Any],
    sessions: list[SessionRecord],
    session_rewards: dict[str, float | None],
    db: Path,
    limit: int,
) -> None:
    """The app session table (a store ``agentloop serve`` wrote): the last ``limit`` sessions."""
    served = printable(str(server.get("model", "?")))
    trained = sum(rec.trained is not None for rec in sessions)
    w(
        f"{len(sessions)} app sessions in {db} (served model {served}; {trained} trained on by serve --train)\n"
    )
    w(f"{'session':<22} {'calls':>5} {'reward':>7} {'trained':<16} first message\n")
    for rec in sessions[-limit:]:
        reward = session_rewards[rec.session_id]
        r = "-" if reward is None else f"{reward:.3f}"
        head = rec.calls[:1]
        first = json.dumps(head[0].messages[-1].get("content") if head and head[0].messages else "")
        w(
            f"{printable(rec.session_id[:21]):<22} {len(rec.call_json):>5} {r:>7} {_trained(rec):<16} "
            f"{printable(first[:60])}\n"
        )


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


def _print_trajectory(
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


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _tokenizer(run_dir: Path, model: str | None = None, named_by: str | None = None) -> Any:
    """The tokenizer ``model`` names (the user's ``--model``: may be downloaded), else the one the run's
    files name (``named_by``, or the run's config.json): a local folder only, never a download."""
    from transformers import AutoTokenizer

    from agentloop.engine.models import ModelResolutionError, resolve_model

    if model is None or named_by is not None:
        if model is None:
            config = _config(run_dir)
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
