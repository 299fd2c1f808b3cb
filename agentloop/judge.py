"""Rewards from an LLM judge: the attempts at one task scored relative to each other (RULER-style).

::

    judge = al.judge_reward(rubric="...")                    # the trainer's served model judges
    judge = al.judge_reward(rubric="...", llm=al.LLM(base_url=..., model=..., api_key=...))  # any other
    Trainer(config).fit(agent, tasks, reward=judge)          # the agent returns None

Why the trainer calls it: the attempts at one task in one step are separate rollouts (``rollout.n``
copies, run by any runner in any order), so a relative judge can only score once the whole group has
finished. After a step's rollouts have finished, the trainer groups the succeeded ones by task (the
same input, as GRPO's groups), sends each group to the judge in one request, and writes each attempt's
score to the store as a Reward span named ``judge`` (the store takes a late Reward span on a succeeded
attempt: durable, shown by ``agentloop inspect``). The triplets are then built as usual: an attempt's
reward is the sum of its Reward spans, so an agent that returns None is rewarded by the judge alone,
and one that returns a value (a format penalty, say) adds it to the judge's score. Validation
rollouts are judged the same way (a group of ``val_kwargs.n`` attempts; with n = 1 an absolute score).

The request: the judge's instructions and the rubric as the system message; the task and the N
trajectories (each attempt's conversation rebuilt from its recorded LLM calls; messages that every
trajectory shares shown once) as the user message; the answer must be only a JSON object
``{"scores": [{"trajectory_id": "1", "explanation": "...", "score": 0.8}, ...]}`` with one score in
[0, 1] per trajectory (the whole answer, or its one ```json block). Sent at temperature 0 with a
deadline per request. A malformed answer is retried ``max_retries`` times, each retry telling the
judge what was wrong (an identical request at temperature 0 would only repeat it), then ``JudgeError``
names what came: never a silent 0. With ``on_failure="skip"`` the trainer leaves that group
unrewarded instead (its attempts train on nothing, counted in ``judge/failed_groups`` and logged).

Cache: verdicts are kept by a digest of (rubric, task, trajectories, judge model, served weights
version): the same group is never sent twice; ``cache_file`` (the trainer uses ``judge.jsonl`` in the
run folder) also keeps them on disk, one JSON line per verdict, raw answer included.

Traps: a judge call of the served model runs on the policy being trained (its verdicts change as it
learns) and competes with the agents for the engine; a small model is a poor judge (SmolLM2-135M often
does not answer in JSON at all; benchmarks/results/judge_agreement_cpu.json measures it).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio

from agentloop.errors import JudgeError
from agentloop.logging import get_logger
from agentloop.resources import LLM
from agentloop.types import LLMCall, Reward, RolloutStatus, Span

if TYPE_CHECKING:
    from agentloop.store.base import Store

log = get_logger("agentloop.judge")

__all__ = ["DEFAULT_RUBRIC", "RewardJudge", "Verdict", "judge_reward", "trajectory_messages"]

DEFAULT_RUBRIC = """\
- A trajectory that reaches the task's goal scores higher than one that does not.
- Among trajectories that reach it, a shorter and cleaner one scores higher.
- Among trajectories that fail, one that gets closer to the goal scores higher.
- Use the whole range from 0 (useless) to 1 (the goal reached well)."""  # ART RULER's default, in short

_SYSTEM = """\
You are a judge. Several trajectories are attempts by an AI agent at the same task. Score each one \
from 0 to 1 by the rubric below; the scores are compared with each other, so a better trajectory \
must get a higher score.

Rubric:
{rubric}

Answer with only a JSON object and no other text:
{{"scores": [{{"trajectory_id": "1", "explanation": "<one short sentence>", "score": <a number from 0 to 1>}}, ...]}}
with exactly one entry per trajectory, trajectory_id "1" to "{n}"."""

_FENCED = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_CACHE_LIMIT = 100_000  # verdicts kept in memory (least recently used dropped); ~1 KB each


@dataclass
class Verdict:
    """One group's judgment: a score per trajectory, in the order they were given."""

    scores: list[float]
    explanations: list[str]
    model: str  # the judge model that answered
    key: str  # the cache key: digest of rubric, task, trajectories, model (and weights version)
    raw: str = ""  # the judge's answer text
    tries: int = 1  # requests it took (1 + retries); 0 when it came from the cache
    cached: bool = False
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # what the caller adds (rollout ids, step)


class RewardJudge:
    """Scores a group of attempts at one task relative to each other with an OpenAI-compatible LLM.

    Args:
        rubric: what makes one trajectory better than another (the judge's system message quotes it).
        llm: the judge endpoint (``al.LLM``); None: the trainer's served model (``Trainer.fit``), else
            pass ``llm=`` to ``judge``/``score``.
        max_retries: further requests after a malformed answer (each says what was wrong); then JudgeError.
        timeout_s: deadline of one request (network, queueing and generation).
        max_tokens: the judge's answer budget (an answer cut at it is malformed: raise it for big groups).
        max_chars: each trajectory's text is cut to this many characters (head and tail kept), so a
            group of long trajectories still fits the judge's context.
        task_text: how a task is shown to the judge (default: a string as it is, else its JSON); e.g.
            ``lambda t: t["question"]`` keeps a reference answer away from it.
        cache_file: a JSON-lines file of verdicts, read on first use and appended to.
        concurrency: groups judged at once by ``judge_rollouts``.
        on_failure: ``raise`` (JudgeError stops the step) or ``skip`` (the group gets no reward, logged).
        name: the Reward span name the scores are written under.
        extra_body: extra request fields (e.g. ``{"response_format": {"type": "json_object"}}``).
    """

    def __init__(
        self,
        rubric: str = DEFAULT_RUBRIC,
        llm: LLM | None = None,
        *,
        max_retries: int = 2,
        timeout_s: float = 300.0,
        max_tokens: int = 1024,
        max_chars: int = 6000,
        task_text: Callable[[Any], str] | None = None,
        cache_file: str | Path | None = None,
        concurrency: int = 4,
        on_failure: Literal["raise", "skip"] = "raise",
        name: str = "judge",
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(rubric, str) or not rubric.strip():
            raise ValueError(
                "rubric must be a non-empty string: what makes one trajectory better than another"
            )
        if llm is not None and not isinstance(llm, LLM):
            raise TypeError(
                f"llm must be an al.LLM(base_url, model, api_key) or None, got {type(llm).__name__}"
            )
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if max_tokens < 16 or max_chars < 200 or concurrency < 1:
            raise ValueError(
                f"max_tokens must be >= 16, max_chars >= 200 and concurrency >= 1; got {max_tokens}, "
                f"{max_chars}, {concurrency}"
            )
        if on_failure not in ("raise", "skip"):
            raise ValueError(f"on_failure must be 'raise' or 'skip', got {on_failure!r}")
        self.rubric = rubric
        self.llm = llm
        self.max_retries = max_retries
        self.timeout_s = float(timeout_s)
        self.max_tokens = int(max_tokens)
        self.max_chars = int(max_chars)
        self.task_text = task_text
        self.cache_file = Path(cache_file) if cache_file is not None else None
        self.concurrency = int(concurrency)
        self.on_failure = on_failure
        self.name = name
        self.extra_body = dict(extra_body or {})
        self.requests = 0  # requests sent to the judge endpoint (retries included)
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self._cache_loaded = False

    def describe(self) -> dict[str, Any]:
        """What decides the verdicts (no key): part of a training run's identity."""
        llm = None if self.llm is None else {"base_url": self.llm.base_url, "model": self.llm.model}
        return {"rubric": self.rubric, "llm": llm, "name": self.name, "max_chars": self.max_chars}

    def for_run(self, cache_file: Path) -> RewardJudge:
        """A copy that also keeps its verdicts in ``cache_file`` (unless this judge names its own)."""
        copy = RewardJudge.__new__(RewardJudge)
        copy.__dict__.update(self.__dict__)
        copy._cache = OrderedDict(self._cache)
        copy.cache_file = self.cache_file or cache_file
        copy._cache_loaded = False
        return copy

    # ------------------------------------------------------------ the prompt and the answer

    def messages(self, task: Any, trajectories: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, str]]:
        """The chat request for one group: instructions + rubric, then the task and the trajectories."""
        n = len(trajectories)
        shared = _common_prefix(trajectories) if n > 1 else 0
        parts = [f"Task:\n{self._task(task)}"]
        if shared:
            parts.append("Shared by every trajectory (shown once):\n" + _render(trajectories[0][:shared]))
        for i, conversation in enumerate(trajectories, 1):
            text = _cut(_render(conversation[shared:]) or "(no messages)", self.max_chars)
            parts.append(f'<trajectory id="{i}">\n{text}\n</trajectory>')
        system = _SYSTEM.format(rubric=self.rubric.strip(), n=n)
        return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]

    @staticmethod
    def parse(text: str, n: int) -> tuple[list[float], list[str]]:
        """Scores and explanations from a judge's answer; ValueError saying what is wrong with it."""
        body = text.strip()
        fenced = _FENCED.findall(body)
        if not body.startswith("{") and len(fenced) == 1:
            body = fenced[0].strip()
        try:
            data = json.loads(body)
        except ValueError:
            raise ValueError("the answer is not a JSON object (nor one ```json block)") from None
        entries = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError('the JSON object has no "scores" list')
        if len(entries) != n:
            raise ValueError(f'"scores" has {len(entries)} entries for {n} trajectories')
        scores: dict[str, float] = {}
        notes: dict[str, str] = {}
        for entry in entries:
            if not isinstance(entry, dict) or "trajectory_id" not in entry or "score" not in entry:
                raise ValueError(f'an entry is not {{"trajectory_id": ..., "score": ...}}: {str(entry)[:80]}')
            tid, score = str(entry["trajectory_id"]).strip(), entry["score"]
            if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
                raise ValueError(f"trajectory {tid}'s score {score!r} is not a number from 0 to 1")
            if tid in scores:
                raise ValueError(f"trajectory_id {tid!r} is scored twice")
            scores[tid], notes[tid] = float(score), str(entry.get("explanation", ""))
        wanted = [str(i) for i in range(1, n + 1)]
        if sorted(scores) != sorted(wanted):
            raise ValueError(f"trajectory_id must be {wanted}, got {list(scores)}")
        return [scores[t] for t in wanted], [notes[t] for t in wanted]

    def cache_key(self, task: Any, trajectories: Any, model: str, version: Any = None) -> str:
        text = json.dumps([self.rubric, self._task(task), trajectories, model, version, self.max_chars],
                          sort_keys=True, default=str)  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    # ------------------------------------------------------------ judging

    async def score(
        self, task: Any, trajectories: Sequence[Sequence[dict[str, Any]]], *, llm: LLM | None = None
    ) -> list[float]:
        """One score in [0, 1] per trajectory (each a list of chat messages), in the order given."""
        return (await self.judge(task, trajectories, llm=llm)).scores

    async def judge(
        self,
        task: Any,
        trajectories: Sequence[Sequence[dict[str, Any]]],
        *,
        llm: LLM | None = None,
        version: Any = None,
    ) -> Verdict:
        """The verdict on one group (from the cache when this group was judged before); ``version``
        (the served weights version) joins the cache key."""
        endpoint = self.llm or llm
        if endpoint is None:
            raise ValueError(
                "this judge has no llm: pass judge_reward(llm=al.LLM(base_url, model, api_key)), or llm= here; "
                "only Trainer.fit(reward=...) supplies the served model"
            )
        if (
            isinstance(trajectories, str | bytes)
            or not isinstance(trajectories, Sequence)
            or not trajectories
        ):
            raise ValueError("trajectories must be a non-empty list, one list of chat messages per attempt")
        convs = [list(t) for t in trajectories]
        key = self.cache_key(task, convs, endpoint.model, version)
        self._load_cache()
        if key in self._cache:
            self._cache.move_to_end(key)
            hit = self._cache[key]
            return Verdict(hit.scores, hit.explanations, hit.model, key, hit.raw, 0, True)
        t0 = time.perf_counter()
        messages = self.messages(task, convs)
        reason, text, finish = "", "", None
        for attempt in range(1 + self.max_retries):
            text, finish = await self._complete(endpoint, messages)
            if finish == "error":  # no answer (timeout, connection, 5xx): the same request again
                reason = f"the endpoint failed: {text}"
                log.warning("judge.request_failed", model=endpoint.model, attempt=attempt + 1, why=text)
                continue
            try:
                scores, notes = self.parse(text, len(convs))
            except ValueError as exc:
                reason = str(exc) + (" (the answer was cut at max_tokens)" if finish == "length" else "")
                log.warning("judge.malformed", model=endpoint.model, attempt=attempt + 1, why=reason)
                messages = [
                    *messages[:2],
                    {"role": "assistant", "content": text[:4000]},
                    _fix(reason, len(convs)),
                ]
                continue
            verdict = Verdict(
                scores, notes, endpoint.model, key, text, attempt + 1, False, time.perf_counter() - t0
            )
            self._remember(verdict)
            return verdict
        raise JudgeError(
            f"the judge ({endpoint.model} at {endpoint.base_url}) gave no usable scores for {len(convs)} "
            f"trajectories in {1 + self.max_retries} tries: {reason}; its last answer (finish_reason "
            f"{finish}): {text[:300]!r}. Use a judge model that follows the JSON format, raise max_tokens "
            "if answers are cut, or max_retries"
        )

    async def _complete(self, llm: LLM, messages: list[dict[str, str]]) -> tuple[str, str | None]:
        """One request (every judge call goes through here): the answer text and its finish reason.
        A timeout or a server error counts as an answer that cannot be used; a refusal (4xx) raises."""
        import openai

        self.requests += 1
        client = openai.AsyncOpenAI(
            base_url=llm.base_url, api_key=llm.api_key, timeout=self.timeout_s, max_retries=1
        )
        try:
            with anyio.fail_after(self.timeout_s * 2.5):  # the client's own retry included
                resp = await client.chat.completions.create(
                    model=llm.model,
                    messages=messages,  # type: ignore[arg-type]
                    temperature=0.0,
                    max_tokens=self.max_tokens,
                    extra_body=self.extra_body or None,
                )
        except openai.APIStatusError as exc:
            if 400 <= exc.status_code < 500 and exc.status_code not in (408, 409, 429):
                raise JudgeError(
                    f"the judge endpoint {llm.base_url} refused the request ({exc.status_code}): "
                    f"{str(exc)[:300]}; for context_length_exceeded lower max_chars ({self.max_chars})"
                ) from None
            return f"{exc.status_code} {str(exc)[:200]}", "error"
        except (openai.APIConnectionError, openai.APITimeoutError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {str(exc)[:200]}", "error"
        finally:
            await client.close()
        choice = resp.choices[0] if resp.choices else None
        content = choice.message.content if choice is not None else None
        return content or "", choice.finish_reason if choice is not None else None

    # ------------------------------------------------------------ the trainer's hook

    async def judge_rollouts(
        self, store: Store, rollout_ids: Sequence[str], *, llm: LLM | None = None, version: Any = None
    ) -> dict[str, float]:
        """Judge the succeeded rollouts among ``rollout_ids`` in groups of the same task and add each
        latest attempt's score as a Reward span named ``self.name``; returns ``judge/...`` metrics.

        An attempt with no LLM call, or one already judged under this name, is left out."""
        t0 = time.perf_counter()
        groups: dict[str, list[tuple[Any, str, list[Span]]]] = {}
        for rid in rollout_ids:
            rollout = await store.get_rollout(rid)
            if rollout.status is not RolloutStatus.SUCCEEDED:
                continue
            spans = await store.query_spans(rid, "latest")
            calls = [s for s in spans if isinstance(s.payload, LLMCall)]
            done = any(isinstance(s.payload, Reward) and s.payload.name == self.name for s in spans)
            if calls and not done:
                key = json.dumps(rollout.input, sort_keys=True)
                groups.setdefault(key, []).append((rollout.input, calls[0].attempt_id, spans))
        stats = {"groups": 0, "attempts": 0, "failed_groups": 0, "cached_groups": 0, "requests": 0}
        scores: list[float] = []
        errors: list[JudgeError] = []
        limiter = anyio.CapacityLimiter(self.concurrency)
        requests_before = self.requests

        async def one(members: list[tuple[Any, str, list[Span]]]) -> None:
            async with limiter:
                try:
                    verdict = await self.judge(
                        members[0][0],
                        [trajectory_messages(s) for _, _, s in members],
                        llm=llm,
                        version=version,
                    )
                except JudgeError as exc:
                    stats["failed_groups"] += 1
                    errors.append(exc)
                    log.warning("judge.group_failed", attempts=len(members), error=str(exc)[:500])
                    return
            for (_, attempt_id, spans), value in zip(members, verdict.scores, strict=True):
                reward = Reward(value=value, name=self.name)
                await store.add_span(
                    Span(rollout_id=spans[0].rollout_id, attempt_id=attempt_id, payload=reward)
                )
            stats["groups"] += 1
            stats["attempts"] += len(members)
            stats["cached_groups"] += verdict.cached
            scores.extend(verdict.scores)

        async with anyio.create_task_group() as tg:
            for members in groups.values():
                tg.start_soon(one, members)
        if errors and self.on_failure == "raise":
            more = f" (and {len(errors) - 1} other groups failed)" if len(errors) > 1 else ""
            raise JudgeError(
                f"{errors[0]}{more}; judge_reward(on_failure='skip') leaves such groups unrewarded"
            )
        stats["requests"] = self.requests - requests_before
        metrics = {f"judge/{k}": float(v) for k, v in stats.items()}
        if scores:
            metrics["judge/score_mean"] = sum(scores) / len(scores)
        metrics["timing/judge_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------ helpers

    def _task(self, task: Any) -> str:
        if self.task_text is not None:
            return str(self.task_text(task))
        return task if isinstance(task, str) else json.dumps(task, ensure_ascii=False, sort_keys=True)

    def _remember(self, verdict: Verdict) -> None:
        self._cache[verdict.key] = verdict
        while len(self._cache) > _CACHE_LIMIT:
            self._cache.popitem(last=False)
        if self.cache_file is not None:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            with self.cache_file.open("a") as f:
                f.write(json.dumps(asdict(verdict), ensure_ascii=False) + "\n")

    def _load_cache(self) -> None:
        if self._cache_loaded:
            return
        self._cache_loaded = True
        if self.cache_file is None or not self.cache_file.is_file():
            return
        for line in self.cache_file.read_text().splitlines():
            try:
                data = json.loads(line)
                self._cache[data["key"]] = Verdict(**data)
            except (ValueError, KeyError, TypeError):  # a line cut by a crash: judged again if needed
                continue


def judge_reward(rubric: str = DEFAULT_RUBRIC, llm: LLM | None = None, **options: Any) -> RewardJudge:
    """A relative LLM-as-judge reward over a group of attempts: ``Trainer(config).fit(agent, tasks,
    reward=al.judge_reward(rubric=...))``. ``llm=None`` judges with the trainer's served model; the
    options are RewardJudge's (max_retries, timeout_s, max_tokens, max_chars, task_text, cache_file,
    concurrency, on_failure, name, extra_body)."""
    return RewardJudge(rubric, llm, **options)


def trajectory_messages(spans: Sequence[Span]) -> list[dict[str, Any]]:
    """One attempt's conversation, rebuilt from its LLMCall spans in order: each call's messages past
    what the conversation already holds, then the call's response message."""
    conversation: list[dict[str, Any]] = []
    for span in sorted(spans, key=lambda s: s.sequence_id or 0):
        call = span.payload
        if not isinstance(call, LLMCall):
            continue
        shared = _common_prefix([conversation, call.messages])
        conversation.extend(dict(m) for m in call.messages[shared:])
        if call.response_message is not None:
            conversation.append(dict(call.response_message))
    return conversation


def _fix(reason: str, n: int) -> dict[str, str]:
    return {
        "role": "user",
        "content": f"That answer cannot be used: {reason}. Answer again with only the JSON object "
        f'{{"scores": [...]}}: exactly {n} entries, trajectory_id "1" to "{n}", each with a score from 0 to 1.',
    }


def _common_prefix(conversations: Sequence[Sequence[dict[str, Any]]]) -> int:
    """How many leading messages every conversation shares."""
    n = min(len(c) for c in conversations)
    i = 0
    while i < n and all(_same(c[i], conversations[0][i]) for c in conversations[1:]):
        i += 1
    return i


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a.get("role"), _text(a.get("content")), a.get("tool_calls")) == (
        b.get("role"), _text(b.get("content")), b.get("tool_calls"))  # fmt: skip


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _render(messages: Sequence[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        role = str(m.get("role", "?"))
        text = _text(m.get("content")).strip()
        if role == "tool":
            lines.append(f"[tool result] {text}")
            continue
        if text:
            lines.append(f"[{role}] {text}")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            lines.append(f"[{role} calls {fn.get('name', '?')}] {fn.get('arguments', '')}")
    return "\n".join(lines)


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: its head and tail, the middle replaced by a marker."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"
