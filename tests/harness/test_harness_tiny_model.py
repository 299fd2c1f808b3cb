"""Each CLI harness (Codex CLI, Claude Code, opencode) runs one session through ``al.harness.run`` against a
rollout's proxy URL with a real model behind it: the tiny random Llama (the real SmolLM2 tokenizer) with
32768 positions, served by the real TorchEngine, so the harness's own ~8.9k (Codex), ~7.7k (opencode) and
~12.5k (Claude Code) token prompts fit.

The random model's end-of-turn row is raised so that it ends its turns within a few tokens, as a chat
model does (``end_turns``): else every response is cut at max_tokens and Claude Code and Codex end the
session with an error. It writes no tool call, so its text is the session's answer and the harness exits
0. Checked: every call the engine answered is one LLMCall span holding the prompt ids the engine saw and
the ids and log-probs it sampled (and a plain forward of the model agrees: greedy choices, same
log-probs); the calls form a valid tree (agentloop/call_tree.py): ids unique, every parent an earlier call
whose prompt + response the child's prompt starts with, one main root, and a root without tools (opencode's
title call) marked ``side``. A text-only session is one main call for Claude Code and Codex; a second Claude
Code or Codex session resuming the first links its call to the first one's (parent, main branch).

The scripted-model test of the same harnesses (a bug fixed through each one's shell tool, several calls
extending each other) is in test_harness_run.py.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import agentloop as al
from agentloop.call_tree import call_tree
from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.harness import HARNESSES, harness_binary
from agentloop.resources import Resources
from agentloop.sandbox import bwrap_problem
from agentloop.sandbox.errors import SandboxUnavailableError
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, running_proxy

CONTEXT = 32768  # the harnesses' prompts are ~8k (opencode, Codex) to ~13k (Claude Code) tokens
# greedy (enforced over the harness's own temperature), few tokens a call: a random model's text is noise,
# and decode is what costs on 2 cores (the resource's max_tokens is a ceiling over the request's, service.py)
SAMPLING = {"temperature": 0.0, "max_tokens": 32}
TASK = "Print the sum of 2 and 3 with python3, then say what it was."
# a session's deadline: 10-60 s here, but a test run under nice beside a training run on the same 2 cores
# saw sessions starved past 150 s
SESSION_S = 300
# the branches one text-only session makes, as seen with the pinned versions: Claude Code in -p mode sends
# no title or quota call (nonessential traffic is off in its spec, and it sent none with it on); opencode
# asks the same model for the session's title, a root without tools beside its main call
BRANCHES = {"claude": ["main"], "codex": ["main"], "opencode": ["main", "side"]}


def installed(name: str) -> bool:
    try:
        harness_binary(name)
    except SandboxUnavailableError:
        return False
    return True


@dataclass
class Generated:
    prompt_ids: list[int]
    sampling: SamplingParams
    output: TokenOutput


class Recording:
    """The real engine, with every prompt it was given and every output it produced kept, in order."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[Generated] = []

    def __getattr__(self, name: str) -> Any:  # tokenizer, max_context, abort, stats, ...
        return getattr(self.engine, name)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        out = await self.engine.generate(prompt_ids, sampling, request_id=request_id)
        self.calls.append(Generated(list(prompt_ids), sampling, out))
        return out


def end_turns(model: Any, eos_id: int, share: float = 0.2) -> None:
    """Make a random model end its turns, as a chat model does: the output row of ``eos_id`` (untied from
    the input embedding) becomes ``c * u``, u the mean direction of the final hidden states, c such that
    end-of-turn wins greedy decoding at about ``share`` of positions (measured on a random prompt). Else
    greedy decoding of a random model never ends a turn, every response is cut at max_tokens, and the
    harnesses stop with an error (Claude Code: api_error max_output_tokens; Codex: "Incomplete response
    returned, reason: max_output_tokens")."""
    import torch

    ids = torch.randint(3, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hidden, logits = out.hidden_states[-1][0], out.logits[0]  # (T, hidden) after the final norm, (T, V)
    logits[:, eos_id] = -torch.inf
    u = hidden.mean(0) / hidden.mean(0).norm()
    along = hidden @ u
    needed = (logits.max(-1).values / along)[along > 0]  # end-of-turn wins where c * along > the best other
    head = model.lm_head.weight.detach().clone()
    head[eos_id] = torch.quantile(needed, share) * u
    model.lm_head.weight = torch.nn.Parameter(head)
    model.config.tie_word_embeddings = False


@pytest.fixture(scope="module")
def long_model(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The tiny model's weights with CONTEXT positions (RoPE has no table to grow), ending its turns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").float().eval()
    model.config.max_position_embeddings = CONTEXT
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    end_turns(model, int(tokenizer.eos_token_id))  # <|im_end|>: what the chat template ends a turn with
    return model, tokenizer


@pytest.fixture
async def engine(long_model: tuple[Any, Any]) -> AsyncIterator[Recording]:
    from agentloop.engine.torch.engine import TorchEngine

    torch_engine = TorchEngine(*long_model, device="cpu", max_context=CONTEXT, max_batch_size=4)
    await torch_engine.start()
    try:
        yield Recording(torch_engine)
    finally:
        await torch_engine.stop()


def check_greedy(model: Any, call: LLMCall) -> None:
    """Each response token is the model's greedy choice where it was sampled, and its recorded log-prob is
    ``log_softmax(logits)[token]`` there (T = 0: the raw logits, engine/base.py), up to float noise between
    the engine's chunked prefill + cached decode and one plain forward."""
    import torch

    ids = torch.tensor([call.prompt_ids + call.response_ids[:-1]])
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(call.response_ids)).logits[0]  # (response, V): not (T, V)
    logprobs = torch.log_softmax(logits, -1)
    chosen = logprobs.gather(1, torch.tensor(call.response_ids)[:, None])[:, 0]
    assert torch.all(chosen >= logprobs.max(-1).values - 1e-3), (call.call_id, call.response_ids)
    recorded = torch.tensor(call.response_logprobs)
    assert torch.allclose(chosen, recorded, atol=1e-3), (call.call_id, chosen, recorded)


def check_tree(calls: list[LLMCall]) -> list[str]:
    """The calls form one valid tree; returns each call's branch."""
    nodes = call_tree(calls)
    ids = [n.call_id for n in nodes]
    assert all(c.call_id is not None for c in calls) and len(set(ids)) == len(ids), ids
    position = {n.call_id: k for k, n in enumerate(nodes)}
    for k, (call, node) in enumerate(zip(calls, nodes, strict=True)):
        assert node.call_id == call.call_id and node.parent_call_id == call.parent_call_id
        if node.parent_call_id is not None:
            p = position[node.parent_call_id]
            assert p < k, (k, node)  # a parent is an earlier call ...
            parent = calls[p]
            head = parent.prompt_ids + parent.response_ids  # ... that this call's prompt extends exactly
            assert call.prompt_ids[: len(head)] == head and call.ledger_break is None
            assert node.branch == nodes[p].branch  # a child stays on its parent's branch
    branches = [n.branch for n in nodes]
    roots = [k for k, n in enumerate(nodes) if n.parent_call_id is None]
    assert roots and roots[0] == 0 and branches.count("main") >= 1
    assert sum(1 for k in roots if branches[k] == "main") == 1, branches
    for k in roots:
        if not calls[k].tools and branches[k] != "main":  # a root without tools: a side call
            assert branches[k] == "side", (k, branches)
    return branches


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("harness", sorted(HARNESSES))
async def test_each_harness_runs_one_session_on_a_tiny_long_context_model(
    harness: str, engine: Recording, long_model: tuple[Any, Any]
) -> None:
    if not installed(harness):
        pytest.skip(f"{harness} is not installed: make harnesses installs {HARNESSES[harness].npm_package}")
    store = MemoryStore()
    started = time.monotonic()
    async with running_proxy(engine, store) as proxy:
        await store.add_resources(
            Resources(items={"llm": proxy.as_resource("tiny-long", SAMPLING, enforce_sampling=True)})
        )
        await store.enqueue_rollout({"prompt": TASK})
        att = await store.dequeue_rollout("test-worker")
        assert att is not None
        llm = al.LLM(base_url=attempt_url(proxy, att), model="tiny-long")
        with anyio.fail_after(360):
            result = await al.harness.run(harness, TASK, llm, timeout_s=SESSION_S, context_window=CONTEXT)
    wall = time.monotonic() - started
    tail = f"{harness} after {wall:.0f}s: {result.run.stderr[-3000:]}\n{result.run.stdout[-2000:]}"
    # the session ends by itself: exit 0, the random model's text as its answer
    assert not result.run.timed_out and result.run.exit_code == 0, tail
    assert result.ok and result.final_message is not None, tail

    spans = await store.query_spans(att.rollout_id)
    calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
    assert calls and all(c.error is None and c.model == "tiny-long" for c in calls), tail
    # every call the engine answered is recorded once, with the engine's exact prompt, ids and log-probs
    # (calls can finish out of order, e.g. Claude Code's side calls beside its first main call)
    produced = Counter(
        (tuple(g.prompt_ids), tuple(g.output.token_ids), tuple(g.output.logprobs or [])) for g in engine.calls
    )
    recorded = Counter(
        (tuple(c.prompt_ids), tuple(c.response_ids), tuple(c.response_logprobs or [])) for c in calls
    )
    assert recorded == produced and len(calls) == len(engine.calls), (len(calls), len(engine.calls))
    for c in calls:
        assert c.prompt_ids and 0 < len(c.response_ids) <= SAMPLING["max_tokens"]
        assert c.response_logprobs is not None and len(c.response_logprobs) == len(c.response_ids)
        assert c.sampling.get("temperature") == 0.0  # enforced over what the harness asked
        assert c.finish_reason == "stop", c.finish_reason  # the turn ended, not cut at max_tokens
    # the harness's own prompt, not a trimmed one: the long context is what is tested
    assert max(len(c.prompt_ids) for c in calls) > 4096, [len(c.prompt_ids) for c in calls]
    # and they are the model's: each response token is its greedy choice after the prompt + the tokens
    # before it, with its log-prob as recorded, re-run in one plain forward
    for c in calls:
        check_greedy(long_model[0], c)
    branches = check_tree(calls)
    assert sorted(branches) == sorted(BRANCHES[harness]), branches
    print(
        f"\n{harness}: {len(calls)} calls, prompts {[len(c.prompt_ids) for c in calls]} tokens, "
        f"branches {branches}, engine latency {[round(c.latency_s or 0, 1) for c in calls]}s, {wall:.1f}s"
    )


SESSION_ID = (
    "5e55e000-0000-4000-8000-000000000043"  # Claude Code's first session (--session-id), resumed after
)
# prints each session file Codex kept under its HOME (the workspace's .home): the check command's output
CODEX_SESSIONS = 'cd .home/.codex/sessions && for f in */*/*/*.jsonl; do echo "FILE $f"; cat "$f"; done'


def claude_session(workdir: str) -> str:
    """Where Claude Code keeps session SESSION_ID, relative to HOME, for a session run in ``workdir``."""
    return f".claude/projects/{re.sub(r'[^A-Za-z0-9]', '-', workdir)}/{SESSION_ID}.jsonl"


async def resumed_sessions(harness: str, llm: al.LLM) -> tuple[al.harness.HarnessResult, ...]:
    """One session, then a second that resumes it with its session file carried into the new sandbox:
    Claude Code ``--session-id`` then ``--resume`` (its file's path follows the workdir); Codex ``exec``
    then ``exec resume <id>`` (the file read back by the first run's check command)."""
    again = "Say it once more."
    if harness == "claude":
        where = f".home/{claude_session('/workspace')}"  # bwrap's workdir
        first = await al.harness.run(
            "claude", TASK, llm, timeout_s=SESSION_S, args=["--session-id", SESSION_ID], collect=[where]
        )
        assert first.ok and where in first.files, first.run.stderr[-3000:]
        kept = first.files[where]
        second = await al.harness.run(
            "claude", again, llm, timeout_s=SESSION_S, args=["--resume", SESSION_ID],
            home_files=lambda workdir: {claude_session(workdir): kept},
        )  # fmt: skip
        return first, second
    first = await al.harness.run(
        "codex", TASK, llm, timeout_s=SESSION_S, context_window=CONTEXT, check=["sh", "-c", CODEX_SESSIONS]
    )
    assert first.ok and first.check is not None, first.run.stderr[-3000:]
    found = re.match(r"FILE (\S+/rollout-\S+-([0-9a-f-]{36})\.jsonl)\n", first.check.stdout)
    assert found is not None, first.check.stdout[:500]
    path, session = found.groups()
    kept = first.check.stdout[found.end() :]
    second = await al.harness.run(
        "codex", again, llm, timeout_s=SESSION_S, context_window=CONTEXT, args=["resume", session],
        home_files={f".codex/sessions/{path}": kept},
    )  # fmt: skip
    return first, second


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")
@pytest.mark.parametrize("harness", ["claude", "codex"])
async def test_a_resumed_session_extends_the_first_sessions_call(
    harness: str, engine: Recording, long_model: tuple[Any, Any]
) -> None:
    """Two sessions on one attempt, the second resuming the first: its call sends the first call's
    conversation back with the model's answer in it, so the ledger links it to that call (its parent, on
    the main branch) and its prompt starts with the first call's prompt + the ids the model produced."""
    if not installed(harness):
        pytest.skip(f"{harness} is not installed: make harnesses installs {HARNESSES[harness].npm_package}")
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        await store.add_resources(
            Resources(items={"llm": proxy.as_resource("tiny-long", SAMPLING, enforce_sampling=True)})
        )
        await store.enqueue_rollout({"prompt": TASK})
        att = await store.dequeue_rollout("test-worker")
        assert att is not None
        llm = al.LLM(base_url=attempt_url(proxy, att), model="tiny-long")
        with anyio.fail_after(540):
            _, second = await resumed_sessions(harness, llm)
    assert second.ok, second.run.stderr[-3000:] + second.run.stdout[-2000:]
    calls = [s.payload for s in await store.query_spans(att.rollout_id) if isinstance(s.payload, LLMCall)]
    assert len(calls) == len(engine.calls) == 2, [len(c.prompt_ids) for c in calls]
    for c in calls:
        check_greedy(long_model[0], c)
    one, two = calls
    assert check_tree(calls) == ["main", "main"] and two.parent_call_id == one.call_id, two.ledger_break
    head = one.prompt_ids + one.response_ids
    assert len(two.prompt_ids) > len(head) and two.prompt_ids[: len(head)] == head
