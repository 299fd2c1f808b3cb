"""``RewardJudge``: one group of attempts at a task scored relative to each other by an LLM.

Each group goes out as one chat request (``agentloop.judge.prompt``) at temperature 0 with a deadline
per request. A malformed answer is retried ``max_retries`` times, each retry telling the judge what was
wrong, then ``JudgeError`` names what came: never a silent 0. Verdicts are cached
(``agentloop.judge.cache``); ``judge_rollouts`` is the trainer's hook (``agentloop.judge.rollouts``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio

from agentloop.errors import JudgeError
from agentloop.judge.cache import Verdict, VerdictCache, verdict_key
from agentloop.judge.prompt import DEFAULT_RUBRIC, judge_messages, parse_answer, retry_message
from agentloop.judge.rollouts import judge_rollouts
from agentloop.logging import get_logger
from agentloop.resources import LLM

if TYPE_CHECKING:
    from agentloop.store.base import Store

log = get_logger("agentloop.judge")

__all__ = ["RewardJudge", "judge_reward"]


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
        self.concurrency = int(concurrency)
        self.on_failure = on_failure
        self.name = name
        self.extra_body = dict(extra_body or {})
        self.requests = 0  # requests sent to the judge endpoint (retries included)
        self._cache = VerdictCache(cache_file)

    @property
    def cache_file(self) -> Path | None:
        """Where verdicts are kept on disk (None: in memory only)."""
        return self._cache.path

    def describe(self) -> dict[str, Any]:
        """What decides the verdicts (no key): part of a training run's identity."""
        llm = None if self.llm is None else {"base_url": self.llm.base_url, "model": self.llm.model}
        return {"rubric": self.rubric, "llm": llm, "name": self.name, "max_chars": self.max_chars}

    def for_run(self, cache_file: Path) -> RewardJudge:
        """A copy that also keeps its verdicts in ``cache_file`` (unless this judge names its own)."""
        copy = RewardJudge.__new__(RewardJudge)
        copy.__dict__.update(self.__dict__)
        copy._cache = self._cache.copy(self.cache_file or cache_file)
        return copy

    def messages(self, task: Any, trajectories: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, str]]:
        """The chat request for one group: instructions + rubric, then the task and the trajectories."""
        return judge_messages(self.rubric, self._task(task), trajectories, self.max_chars)

    @staticmethod
    def parse(text: str, n: int) -> tuple[list[float], list[str]]:
        """Scores and explanations from a judge's answer; ValueError saying what is wrong with it."""
        return parse_answer(text, n)

    def cache_key(self, task: Any, trajectories: Any, model: str, version: Any = None) -> str:
        """The digest this judge caches a group's verdict under."""
        return verdict_key(self.rubric, self._task(task), trajectories, model, version, self.max_chars)

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
        hit = self._cache.get(key)
        if hit is not None:
            return hit
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
                    retry_message(reason, len(convs)),
                ]
                continue
            verdict = Verdict(
                scores, notes, endpoint.model, key, text, attempt + 1, False, time.perf_counter() - t0
            )
            self._cache.put(verdict)
            return verdict
        raise JudgeError(
            f"the judge ({endpoint.model} at {endpoint.base_url}) gave no usable scores for {len(convs)} "
            f"trajectories in {1 + self.max_retries} tries: {reason}; its last answer (finish_reason "
            f"{finish}): {text[:300]!r}. Use a judge model that follows the JSON format, raise max_tokens "
            "if answers are cut, or max_retries"
        )

    async def judge_rollouts(
        self, store: Store, rollout_ids: Sequence[str], *, llm: LLM | None = None, version: Any = None
    ) -> dict[str, float]:
        """Judge the succeeded rollouts among ``rollout_ids`` in groups of the same task and add each
        latest attempt's score as a Reward span named ``self.name``; returns ``judge/...`` metrics
        (``agentloop.judge.rollouts.judge_rollouts``)."""
        return await judge_rollouts(self, store, rollout_ids, llm=llm, version=version)

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

    def _task(self, task: Any) -> str:
        if self.task_text is not None:
            return str(self.task_text(task))
        return task if isinstance(task, str) else json.dumps(task, ensure_ascii=False, sort_keys=True)


def judge_reward(rubric: str = DEFAULT_RUBRIC, llm: LLM | None = None, **options: Any) -> RewardJudge:
    """A relative LLM-as-judge reward over a group of attempts: ``Trainer(config).fit(agent, tasks,
    reward=al.judge_reward(rubric=...))``. ``llm=None`` judges with the served model; the options
    are RewardJudge's (max_retries, timeout_s, max_tokens, max_chars, task_text, cache_file,
    concurrency, on_failure, name, extra_body)."""
    return RewardJudge(rubric, llm, **options)
