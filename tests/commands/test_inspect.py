"""`agentloop inspect`: unknown rollout ids, and the store and session log `agentloop serve` writes.

Real components: a SQLiteStore file, a real Proxy on a loopback port (the echo engine with the real
SmolLM2 tokenizer) and the real command; nothing is mocked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentloop.commands import inspect as inspect_cmd
from agentloop.commands.inspect_text import printable
from agentloop.proxy.server import Proxy
from agentloop.proxy.sessions import read_saved_sessions
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptStatus, LLMCall, Reward, Span
from tests.proxy.engines import EchoEngine


def _inspect(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="agentloop")
    inspect_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["inspect", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def run_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A run folder like training writes: store.db with two finished validation rollouts, config.json."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def fill() -> None:
        store = SQLiteStore(tmp_path / "store.db")
        try:
            for question in ("What is 2 + 2?", "What is 3 + 3?"):
                await store.enqueue_rollout({"question": question}, mode="val")
                att = await store.dequeue_rollout("w")
                assert att is not None
                rid, aid = att.rollout_id, att.attempt.attempt_id
                prompt = tok.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
                )
                response = [*tok.encode("<answer>4</answer>", add_special_tokens=False), tok.eos_token_id]
                call = LLMCall(
                    prompt_ids=tok.encode(prompt, add_special_tokens=False),
                    response_ids=response,
                    response_logprobs=[-0.5] * len(response),
                )
                await store.add_span(Span(rollout_id=rid, attempt_id=aid, payload=call))
                await store.add_span(Span(rollout_id=rid, attempt_id=aid, payload=Reward(value=1.0)))
                await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
        finally:
            await store.close()

    anyio.run(fill)
    config = {"actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_unknown_rollout_id_says_it_does_not_exist(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect(str(run_dir), "--rollout", "ro-doesnotexist", "--no-color", capsys=capsys)
    assert code == 2
    assert "'ro-doesnotexist': no rollout or session has this id (2 rollouts, 0 sessions" in err
    assert "give more of the id" not in err
    assert "2 rollouts in" in out  # the table with the real ids is still printed


def test_ambiguous_prefix_asks_for_more_and_a_full_id_prints(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _inspect(str(run_dir), "--rollout", "ro-", "--no-color", capsys=capsys)
    assert code == 2 and "starts 2 ids" in err and "give more of the id" in err

    async def first_id() -> str:
        store = SQLiteStore(run_dir / "store.db")
        try:
            return (await store.list_rollouts())[0].rollout_id
        finally:
            await store.close()

    rid = anyio.run(first_id)
    code, out, _ = _inspect(str(run_dir), "--rollout", rid[:12], "--no-color", capsys=capsys)
    assert code == 0 and f"trajectory of {rid}" in out
    assert "[model]<answer>4</answer>" in out and "-> reward 1.0" in out


async def _serve_two_sessions(store_path: Path, tokenizer: Any) -> tuple[str, str, str]:
    """What `agentloop serve` does (a Proxy on a SQLiteStore file), then two app sessions."""
    store = SQLiteStore(store_path)
    engine = EchoEngine(tokenizer, reply=lambda prompt, sampling: "Paris is the capital.")
    try:
        async with Proxy(engine, store) as proxy, httpx.AsyncClient(timeout=20) as http:
            chat = {
                "model": proxy.model_name,
                "messages": [{"role": "user", "content": "Capital of France?"}],
            }
            with anyio.fail_after(30):
                first = await http.post(f"{proxy.session_base_url}/chat/completions", json=chat)
                sid = first.headers["x-session-id"]
                follow = {**chat, "messages": [*chat["messages"], first.json()["choices"][0]["message"],
                                               {"role": "user", "content": "And of Italy?"}]}  # fmt: skip
                await http.post(
                    f"{proxy.session_base_url}/chat/completions", json=follow, headers={"X-Session-Id": sid}
                )
                rewarded = await http.post(
                    f"{proxy.session_base_url}/sessions/{sid}/reward", json={"reward": 0.75}
                )
                assert rewarded.status_code == 200, rewarded.text
                other = await http.post(
                    f"{proxy.session_base_url}/chat/completions",
                    json=chat,
                    headers={"X-Session-Id": "app-42"},
                )
                assert other.status_code == 200
            assert proxy.session_store == store_path
        return sid, str(store_path), proxy.model_name
    finally:
        await store.close()


def test_the_store_agentloop_serve_wrote_opens(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store_path = tmp_path / "agentloop-serve.db"  # serve's default --store, in the folder it ran in
    sid, log, model = anyio.run(_serve_two_sessions, store_path, tokenizer)
    assert log == str(store_path)

    server, sessions = read_saved_sessions(log)  # the durable record, in the store itself
    assert server["model"] == model and server["tokenizer"] == str(tiny_model_dir)
    assert [s.session_id for s in sessions] == [sid, "app-42"]
    assert [len(s.calls) for s in sessions] == [2, 1] and [r.value for r in sessions[0].rewards] == [0.75]
    one, two = sessions[0].calls
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids

    for target in (tmp_path, store_path):  # the folder serve ran in, or the file it printed
        code, out, err = _inspect(str(target), "--no-color", capsys=capsys)
        assert code == 0, err
        assert "0 rollouts in" in out
        assert f"2 app sessions in {log} (served model {model}; 0 trained on by serve --train)" in out
        assert f"trajectory of session {sid}" in out  # the rewarded session is shown by default
        assert out.count("[model]Paris is the capital.") == 2 and "[masked]" in out  # the user turn: masked
        assert "-> reward 0.75" in out
        # the session's two calls: ids recorded on the session route, one linear main conversation
        assert (
            "\n  #1 main: prompt " in out and "\n  #2 main <- #1: prompt " in out and "sample 1/" not in out
        )

    code, out, _ = _inspect(str(tmp_path), "--rollout", "app-4", "--no-color", capsys=capsys)
    assert code == 0 and "trajectory of session app-42" in out


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hub repos something tried to download (the network edge, replaced: nothing is fetched)."""
    from agentloop.engine import models

    tried: list[str] = []

    def download(repo_id: str) -> Path:
        tried.append(repo_id)
        raise models.ModelResolutionError(f"test: would have downloaded {repo_id!r}")

    monkeypatch.setattr(models, "_download_from_hub", download)
    return tried


def test_a_hub_repo_a_run_config_names_is_not_downloaded(
    run_dir: Path, tiny_model_dir: Path, downloads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44 finding 14: ``inspect`` downloaded whatever hub repo a (hostile) run named."""
    config = {"actor_rollout_ref": {"model": {"path": "evil-org/exfil-tokenizer"}}}
    (run_dir / "config.json").write_text(json.dumps(config))
    code, _, err = _inspect(str(run_dir), "--no-color", capsys=capsys)
    assert downloads == []
    assert code == 2 and "names the model 'evil-org/exfil-tokenizer'" in err, err
    assert "not a local model folder" in err and "pass --model" in err
    code, out, err = _inspect(str(run_dir), "--no-color", "--model", str(tiny_model_dir), capsys=capsys)
    assert code == 0 and "[model]<answer>4</answer>" in out, err  # the user's --model is used instead


def test_a_hub_repo_a_serve_store_names_is_not_downloaded(
    tmp_path: Path, tiny_model_dir: Path, downloads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    from transformers import AutoTokenizer

    store_path = tmp_path / "agentloop-serve.db"
    anyio.run(_serve_two_sessions, store_path, AutoTokenizer.from_pretrained(tiny_model_dir))
    with sqlite3.connect(store_path) as conn:  # what a hostile store holds
        meta = {"model": "evil-org/exfil-model", "tokenizer": "evil-org/exfil-tokenizer"}
        conn.execute("UPDATE store_meta SET value = ? WHERE key = 'serve'", (json.dumps(meta),))
    code, _, err = _inspect(str(store_path), "--no-color", capsys=capsys)
    assert downloads == []
    assert code == 2 and "the store's metadata" in err and "'evil-org/exfil-tokenizer'" in err, err
    code, out, err = _inspect(str(store_path), "--no-color", "--model", str(tiny_model_dir), capsys=capsys)
    assert code == 0 and "[model]Paris is the capital." in out, err


def test_a_folder_without_a_store_names_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _inspect(str(tmp_path), capsys=capsys)
    assert code == 2 and "has no store.db" in err and "agentloop-serve.db" in err
    (tmp_path / "a.db").touch()
    (tmp_path / "b.db").touch()
    code, _, err = _inspect(str(tmp_path), capsys=capsys)
    assert code == 2 and "holds several stores (a.db, b.db); give one of them" in err


# ---------------------------------------------------------------- issue 16: read-only, escaped

HOSTILE = "4\x1b[2J\x1b]0;pwned\x07 done\r\u202eevil"


@pytest.fixture
def hostile_run(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A run folder whose one rollout's model output holds terminal escape sequences."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def fill() -> None:
        store = SQLiteStore(tmp_path / "store.db")
        try:
            await store.enqueue_rollout({"question": "q\x1b[31m"}, mode="val")
            att = await store.dequeue_rollout("w")
            assert att is not None
            response = [*tok.encode(HOSTILE, add_special_tokens=False), tok.eos_token_id]
            call = LLMCall(prompt_ids=tok.encode("hi", add_special_tokens=False), response_ids=response,
                           response_logprobs=[-0.5] * len(response))  # fmt: skip
            await store.add_span(
                Span(rollout_id=att.rollout_id, attempt_id=att.attempt.attempt_id, payload=call)
            )
            await store.add_span(
                Span(rollout_id=att.rollout_id, attempt_id=att.attempt.attempt_id, payload=Reward(value=1.0))
            )
            await store.update_attempt(att.rollout_id, att.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
        finally:
            await store.close()

    anyio.run(fill)
    (tmp_path / "config.json").write_text(
        json.dumps({"actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}}})
    )
    return tmp_path


def test_model_text_is_printed_with_its_control_characters_escaped(
    hostile_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _inspect(str(hostile_run), "--no-color", capsys=capsys)
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\r", "\u202e"):
        assert raw not in out
    assert "[model]4\\x1b[2J\\x1b]0;pwned\\x07 done\\x0d\\u202eevil" in out
    # tab and newline stay; an 8-bit CSI does not
    assert printable("a\tb\nc\x9bd") == "a\tb\nc\\x9bd"


def test_inspect_reads_a_store_that_a_running_trainer_holds_locked(
    hostile_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect opens the store read-only (mode=ro): it takes no write lock and writes nothing, so a store
    another process is writing (here: a write transaction held open) is read at once."""
    import sqlite3
    import time

    db = hostile_run / "store.db"
    before = db.read_bytes()
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # as SQLiteStore's worker holds it while it writes
    try:
        started = time.monotonic()
        code, out, err = _inspect(str(hostile_run), "--no-color", capsys=capsys)
        took = time.monotonic() - started
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert code == 0, err
    assert "1 rollouts in" in out and "-> reward 1.0" in out
    assert took < 20  # read-write opening waits for the lock (busy_timeout 30 s) and then fails
    assert db.read_bytes() == before


def test_a_training_rollout_shows_its_advantage_from_a_read_only_store(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The group of a training rollout is read through the read-only store too (its advantage)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def fill() -> list[str]:
        store = SQLiteStore(tmp_path / "store.db")
        ids = []
        try:
            for reward in (1.0, 0.0):  # two attempts at one task in one step: one GRPO group
                await store.enqueue_rollout({"q": 1}, mode="train", metadata={"step": 1, "data_index": 0})
                att = await store.dequeue_rollout("w")
                assert att is not None
                rid, aid = att.rollout_id, att.attempt.attempt_id
                response = [*tok.encode(f"answer {reward}", add_special_tokens=False), tok.eos_token_id]
                call = LLMCall(prompt_ids=tok.encode("hi", add_special_tokens=False), response_ids=response,
                               response_logprobs=[-0.5] * len(response))  # fmt: skip
                await store.add_span(Span(rollout_id=rid, attempt_id=aid, payload=call))
                await store.add_span(Span(rollout_id=rid, attempt_id=aid, payload=Reward(value=reward)))
                await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
                ids.append(rid)
        finally:
            await store.close()
        return ids

    best, worst = anyio.run(fill)
    (tmp_path / "config.json").write_text(
        json.dumps({"actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}}})
    )
    code, out, err = _inspect(str(tmp_path), "--no-color", capsys=capsys)
    assert code == 0, err
    assert f"trajectory of {best}" in out and "-> reward 1.0; advantage per call: +" in out
    code, out, err = _inspect(str(tmp_path), "--rollout", worst, "--no-color", capsys=capsys)
    assert code == 0 and "-> reward 0.0; advantage per call: -0." in out


# ---------------------------------------------------------------- issue 43 item 2: the call tree


@pytest.fixture
def branched_run(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, str]:
    """A run folder whose one rollout holds a main conversation (with a fork), a title call beside it
    and a two-call subagent, as the proxy records them (call ids, parents, branches)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def ids(text: str, eos: bool = False) -> list[int]:
        return [*tok.encode(text, add_special_tokens=False), *([tok.eos_token_id] if eos else [])]

    def turn(role: str, text: str) -> str:
        return f"\n<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n"

    tools: list[dict[str, Any]] = [{"name": "Task", "parameters": {"type": "object", "properties": {}}}]
    main = [{"role": "system", "content": "You code."}, {"role": "user", "content": "Fix the bug."}]
    sub = [{"role": "system", "content": "You search."}, {"role": "user", "content": "Find add()."}]
    p1, r1 = ids("<|im_start|>user\nFix the bug.<|im_end|>\n<|im_start|>assistant\n"), ids("Asking.", True)
    p3, r3 = ids("<|im_start|>user\nFind add().<|im_end|>\n<|im_start|>assistant\n"), ids("Grep.", True)
    p4 = [*p3, *r3, *ids(turn("tool", "m.py:3"))]
    p5, p6 = [*p1, *r1, *ids(turn("tool", "in m.py"))], [*p1, *r1, *ids(turn("tool", "not found"))]
    calls = [  # (prompt, response, call_id, parent, branch, messages, tools, model)
        (p1, r1, 1, None, "main", main, tools, "big"),
        (ids("Title for: Fix the bug."), ids("Bug fix", True), 2, None, None, main[1:], None, "small"),
        (p3, r3, 3, None, None, sub, tools, "big"),
        (p4, ids("add is in m.py", True), 4, 3, None, sub, tools, "big"),
        (p5, ids("Fixed.", True), 5, 1, "main", main, tools, "big"),
        (p6, ids("Retrying.", True), 6, 1, "main", main, tools, "big"),
    ]

    async def fill() -> str:
        store = SQLiteStore(tmp_path / "store.db")
        try:
            await store.enqueue_rollout({"question": "fix"}, mode="val")
            att = await store.dequeue_rollout("w")
            assert att is not None
            rid, aid = att.rollout_id, att.attempt.attempt_id
            for prompt, response, cid, parent, branch, messages, tls, model in calls:
                call = LLMCall(prompt_ids=prompt, response_ids=response, response_logprobs=[-0.5] * len(response),
                               call_id=cid, parent_call_id=parent, branch=branch, messages=messages, tools=tls,
                               model=model)  # fmt: skip
                await store.add_span(Span(rollout_id=rid, attempt_id=aid, payload=call))
            await store.add_span(Span(rollout_id=rid, attempt_id=aid, payload=Reward(value=1.0)))
            await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
            return rid
        finally:
            await store.close()

    rid = anyio.run(fill)
    (tmp_path / "config.json").write_text(
        json.dumps({"actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}}})
    )
    return tmp_path, rid


def test_a_branched_attempt_shows_its_call_tree_and_one_sample_per_branch(
    branched_run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, rid = branched_run
    code, out, err = _inspect(str(run_dir), "--rollout", rid, "--no-color", capsys=capsys)
    assert code == 0, err
    assert "(4 sample(s); green: model tokens" in out
    tree = out.split("calls (each under the call it extends; a fork one step in):\n")[1].split("sample 1/4")[
        0
    ]
    assert tree.splitlines() == [
        "  #1 main: prompt 14, response 4 tokens; reward 0.000",
        "  #5 main <- #1: prompt 32, response 3 tokens; reward 0.000",  # continues #1's sample
        "    #6 main <- #1 (fork): prompt 30, response 4 tokens; reward 1.000",
        "  #2 side: prompt 7, response 4 tokens; reward 0.000",
        "  #3 subagent: prompt 12, response 4 tokens; reward 0.000",
        "  #4 subagent <- #3: prompt 31, response 7 tokens; reward 0.000",
    ]
    for header in ("sample 1/4: main, calls #1 #5", "sample 2/4: side, calls #2",
                   "sample 3/4: subagent, calls #3 #4", "sample 4/4: main, calls #6"):  # fmt: skip
        assert header + "\n" in out
    assert "[model]Asking.<|im_end|>[/model][masked]\n<|im_start|>tool\nin m.py" in out
    assert out.count("advantage per call: -, -\n") == 2 and out.count("advantage per call: -\n") == 2
