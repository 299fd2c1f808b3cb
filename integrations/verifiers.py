"""Train a verifiers environment unchanged: its own episode on the attempt's proxy URL, its rubric's reward.

verifiers 0.4.0 (``import verifiers.v1 as vf``) describes an environment as a ``vf.EnvConfig``: a taskset
(a module exporting a ``vf.Taskset`` whose ``vf.Task`` rows carry ``@vf.reward`` methods and tool servers,
``vf.Toolset``), the seat that plays it (``vf.AgentConfig``: a harness program, a runtime, turn limits),
and the ``vf.Env`` that turns one task into one episode. :class:`VerifiersAgent` is an ``al.Agent`` that,
for one dataset row, runs ``env.run_slot`` (retries, timeouts, scoring: all the environment's own code) with
a ``vf.ModelContext`` whose endpoint is the attempt's proxy URL; every model call the harness makes goes
through verifiers' interception server to the proxy, which records it with exact token ids. The episode's
rewards (``trace.rewards``: the ``@vf.reward`` methods and judges, weighted) are summed as verifiers sums them
(``Trace.reward``) and returned as the attempt's reward (verifiers 0.4.0 has no per-turn rewards)::

    from integrations.verifiers import VerifiersAgent, train_tasks

    agent = VerifiersAgent("vf_arith")                     # a taskset id, an EnvConfig, an Env, or spec
    Trainer(config).fit(agent, train_tasks(agent.env))

``agentloop train`` takes ``agent: verifiers:SPEC`` (:func:`load_env`); without ``train_data`` the tasks are
the environment's own (:func:`train_tasks`). A task is the row's ``TaskData`` as JSON, rebuilt into the
taskset's ``Task`` class for each attempt, as verifiers' own env server does.

An episode that fails (the harness exits non-zero, a reward method raises, a timeout) fails the attempt with
:class:`VerifiersEpisodeError`, whose message holds the environment's own error and traceback.

Why a side virtualenv: verifiers 0.4.0 pins ``mcp==2.0.0`` and ``openai<3``; this project's ``mcp`` extra
(and the frameworks extra's langchain-mcp-adapters) need ``mcp<2`` and the dev venv has openai 3. Install
agentloop (without ``[mcp]``) and verifiers together in their own venv: ``make frameworks`` makes
``.venv/frameworks/verifiers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agentloop.agent import Agent
from agentloop.errors import ConfigError, ImportObjectError, VerifiersEpisodeError
from agentloop.importing import import_object
from agentloop.logging import get_logger
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.types import AttemptedRollout

log = get_logger("integrations.verifiers")

__all__ = [
    "API_KEY_VAR",
    "PREFIX",
    "VerifiersAgent",
    "VerifiersEpisodeError",
    "load_env",
    "train_tasks",
    "val_tasks",
]

PREFIX = "verifiers:"  # a job file's `agent: verifiers:SPEC`
# verifiers' client reads its key from an environment variable (BaseClientConfig.api_key_var) when the
# episode registers with its interception server; its subprocess runtime drops every variable with API_KEY
# in its name, so harness programs never see it. Each attempt has its own key (agentloop/proxy/attempt_keys.py)
# and episodes run concurrently, so each attempt gets its own variable, API_KEY_VAR + "_" + a hash of its URL.
# It is set in os.environ's mapping only (:func:`_hold_key`): a real setenv while the engine's thread runs
# crashed an H200 run at step 9 (SIGSEGV in torch's getenv).
API_KEY_VAR = "AGENTLOOP_VERIFIERS_API_KEY"
SPEC_FORMS = (
    "a taskset module (vf_arith), or module:name / path/to/file.py:name naming a vf.EnvConfig, a vf.Env, "
    "or a function returning one"
)


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            "integrations.verifiers needs verifiers 0.4.0 (import verifiers.v1), which is not importable here "
            f"({exc}); it pins mcp==2.0.0 and openai<3, so install it beside agentloop in a virtualenv of its "
            "own: pip install 'verifiers==0.4.0' -e . (make frameworks makes .venv/frameworks/verifiers)"
        ) from exc
    return vf


def _importable_from_subprocesses(module: Any) -> None:
    """verifiers starts a task's tool servers as ``python -m <module>`` in a subprocess runtime that
    inherits this process's environment: a taskset module found through a job file's folder must be
    found there too (PYTHONPATH), and the harness programs need ``uv`` (next to this Python in a venv)."""
    file = getattr(module, "__file__", None)
    if file:
        top = Path(file).resolve().parent
        for _ in module.__name__.split(".")[1:]:
            top = top.parent
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(top) not in paths and not str(top).startswith(sys.prefix):
            os.environ["PYTHONPATH"] = os.pathsep.join([str(top), *paths])
    bindir = str(Path(sys.executable).parent)
    if shutil.which("uv") is None and shutil.which("uv", path=bindir) is not None:
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])


def load_env(spec: Any, *, base: Path | None = None) -> Any:
    """The ``vf.Env`` that ``spec`` names: a ``vf.Env`` or ``vf.EnvConfig`` (or a dict of one), a taskset id
    (a module exporting its ``vf.Taskset``; it runs with verifiers' defaults but a local subprocess runtime),
    or an import path (``module:name``, ``file.py:name``) to one of those or to a function returning one.
    A leading ``verifiers:`` is dropped. ``base``: the folder relative files and modules are looked up in."""
    vf = _vf()
    if isinstance(spec, str):
        spec = spec.removeprefix(PREFIX).strip()
        if not spec:
            raise ConfigError(f"a verifiers environment spec is {SPEC_FORMS}; got an empty one")
        if ":" in spec:
            obj = import_object(spec, "verifiers environment", base=base, search_cwd=True)
            return load_env(obj() if callable(obj) and not isinstance(obj, type) else obj, base=base)
        if base is not None and str(base) not in sys.path:
            sys.path.insert(0, str(base))
        # a bare taskset id: verifiers' own plain env, on this machine instead of its default Prime sandbox
        spec = {"taskset": {"id": spec}, "agent": {"runtime": {"type": "subprocess"}}}
    if isinstance(spec, vf.Env):
        env = spec
    elif isinstance(spec, vf.EnvConfig | dict):
        try:
            env = vf.load_environment(vf.resolve_env_config(spec))
        except ModuleNotFoundError as exc:
            raise ImportObjectError(f"verifiers environment: {exc}") from exc
    else:
        raise ConfigError(
            f"a verifiers environment spec is {SPEC_FORMS}; got a {type(spec).__name__}: {spec!r:.200}"
        )
    for name, seat in env._agent_specs.items():
        runtime = getattr(seat.runtime, "type", "?")
        if runtime not in ("subprocess", "docker", "podman", "apptainer"):
            raise ConfigError(
                f"verifiers environment {env.config.env_id!r}: seat {name!r} runs in a {runtime!r} runtime, "
                "which reaches the model through a public tunnel; agentloop serves the model on this machine: "
                "give the seat runtime=vf.SubprocessConfig() (or docker)"
            )
    _importable_from_subprocesses(sys.modules[type(env.taskset).__module__])
    return env


def _rows(env: Any, taskset: Any, limit: int | None) -> list[dict[str, Any]]:
    if not taskset.bounded and limit is None:
        raise ConfigError(
            f"verifiers taskset {type(taskset).__name__} is infinite; give a limit (train_tasks(env, limit=N))"
        )
    view = taskset if limit is None else taskset.take(limit)
    return [task.data.model_dump(mode="json", exclude_unset=True) for task in view]


def train_tasks(env: Any, limit: int | None = None) -> list[dict[str, Any]]:
    """The environment's taskset as agentloop tasks: each row's ``TaskData`` as JSON (fields it leaves unset left
    out; not defaults: a message's ``role`` is a default, and the rows must validate back into ``TaskData``)."""
    return _rows(env, env.taskset, limit)


def val_tasks(env: Any, limit: int | None = None) -> list[dict[str, Any]] | None:
    """Held-out tasks where the environment has them: verifiers 0.4.0 has one taskset per environment (a
    split is the taskset's own config, ``select``), so this is None unless the env sets ``eval_taskset``."""
    taskset = getattr(env, "eval_taskset", None)
    return None if taskset is None else _rows(env, taskset, limit)


def _key_var(base_url: str) -> str:
    """The environment variable that holds one attempt's key (its URL names the attempt)."""
    return f"{API_KEY_VAR}_{hashlib.sha256(base_url.encode()).hexdigest()[:16].upper()}"


def _hold_key(var: str, value: str | None) -> None:
    """Set (or, for None, remove) ``var`` in ``os.environ`` as Python code reads it (verifiers'
    ``os.environ.get``), leaving the process's C environment alone. ``os.environ[var] = value`` also calls
    setenv, which may move the environment's array while another thread reads it: torch's C++ reads its
    settings with getenv on the engine's thread, and an episode starts every few milliseconds. Subprocesses
    do not need the key (verifiers' runtime drops every variable with API_KEY in its name)."""
    data = os.environ._data  # type: ignore[attr-defined]  # os._Environ's own mapping, what .get reads
    key = os.environ.encodekey(var)  # type: ignore[attr-defined]
    if value is None:
        data.pop(key, None)
    else:
        data[key] = os.environ.encodevalue(value)  # type: ignore[attr-defined]


def _episode_error(env_id: str, episode: Any) -> str:
    """The message of a failed episode: its first error on the first line (what the console and ``agentloop
    inspect --errors`` show in one line), then each error of the environment with its own traceback."""
    errors = list(episode.errors) + [e for trace in episode.traces for e in trace.errors]
    if not errors:
        return f"verifiers environment {env_id!r}: the episode did not finish ok (no error recorded)"
    first = errors[0]
    head = (str(first.message).strip().splitlines() or [""])[0]
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    parts = [f"verifiers environment {env_id!r}: {first.type}: {head}{more}"]
    for err in errors:
        parts.append(f"{err.type}: {err.message}")
        if err.traceback:
            parts.append(err.traceback.rstrip())
    return "\n".join(parts)


class VerifiersAgent(Agent):
    """An agentloop agent that plays one verifiers episode per attempt and returns its reward.

    ``env``: what :func:`load_env` takes. ``sampling``: request fields (temperature, max_tokens) over the
    attempt LLM's own; verifiers applies them to every model call of the episode.
    """

    def __init__(self, env: Any, *, sampling: dict[str, Any] | None = None, base: Path | None = None) -> None:
        self.env = load_env(env, base=base)
        self.sampling = dict(sampling or {})
        taskset = type(self.env.taskset)
        self._task_cls = taskset.task_type()
        self._data_cls = self._task_cls.data_type()
        # env.serving() (its interception server, shared tool servers) is held while any episode runs:
        # the env keeps one of each, so concurrent episodes share it, as verifiers' own eval does
        self._serving: Any = None
        self._users = 0
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def __repr__(self) -> str:
        return f"<VerifiersAgent {self.env.config.env_id}>"

    def task(self, row: Any) -> Any:
        """The taskset's ``Task`` for one agentloop task (a row from :func:`train_tasks`)."""
        if not isinstance(row, dict):
            raise ConfigError(
                f"a verifiers task is a dict of {self._data_cls.__name__} fields (train_tasks(env) makes them), "
                f"got a {type(row).__name__}"
            )
        data = self._data_cls.model_validate(row)
        return self._task_cls(data, self.env.config.taskset.task)

    def context(self, llm: LLM) -> Any:
        """The ``vf.ModelContext`` of one attempt: the proxy URL as an OpenAI-compatible endpoint, its key
        in the attempt's own environment variable (:func:`_key_var`; the caller removes it afterwards)."""
        vf = _vf()
        var = _key_var(llm.base_url)
        _hold_key(var, llm.api_key)  # the attempt's key, read by verifiers' client as the episode registers
        client = vf.EvalClientConfig(base_url=llm.base_url, api_key_var=var)
        sampling = vf.SamplingConfig.model_validate({**llm.sampling, **self.sampling})
        return vf.ModelContext(model=llm.model, client=client, sampling=sampling)

    def _serving_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """``env.serving()``, started by the first of the concurrent episodes and stopped after the last one.
        A task of its own enters and leaves it (its servers' task groups must be left by the task that
        entered them)."""
        lock = self._serving_lock()
        async with lock:
            if self._users == 0:
                ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                release = asyncio.Event()
                holder = asyncio.create_task(self._hold(ready, release), name="verifiers-serving")
                await ready  # the env's error, if it could not start
                self._serving = (holder, release)
            self._users += 1
        try:
            yield
        finally:
            async with lock:
                self._users -= 1
                if self._users == 0:
                    (holder, release), self._serving = self._serving, None
                    release.set()
                    try:
                        await holder
                    except Exception as exc:  # the episodes are over: a teardown error fails none of them
                        log.warning(
                            "verifiers env teardown failed", env=self.env.config.env_id, error=repr(exc)
                        )

    async def _hold(self, ready: asyncio.Future[None], release: asyncio.Event) -> None:
        try:
            async with self.env.serving():
                ready.set_result(None)
                await release.wait()
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
                return
            raise
        finally:
            if not ready.done():  # cancelled before it started
                ready.cancel()

    async def rollout(
        self, task: Any, resources: Resources | None, rollout: AttemptedRollout
    ) -> float | None:
        llm = resources.get_llm() if resources is not None else None
        if llm is None:
            raise ConfigError("VerifiersAgent needs resources holding an LLM (the trainer's proxy)")
        if isinstance(llm, ProxyLLM):
            llm = llm.resolve(rollout)
        env = self.env
        (slot,) = env.slots(self.task(task))
        try:
            async with self.serving():  # the env's interception server and shared tool servers
                episode = await env.run_slot(slot, self.context(llm))
        finally:
            _hold_key(_key_var(llm.base_url), None)
        if not episode.ok:
            raise VerifiersEpisodeError(_episode_error(env.config.env_id, episode))
        # verifiers' rewards are per trace (named, weighted), not per turn: the attempt's reward is their sum
        total = sum(trace.reward for trace in episode.traces)
        log.debug("verifiers episode", env=env.config.env_id, reward=total, traces=len(episode.traces))
        return total
