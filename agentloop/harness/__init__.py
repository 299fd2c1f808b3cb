"""A real CLI harness (Codex CLI, Claude Code, opencode) as one rollout: ``run`` writes the harness's
config for the attempt's proxy URL, runs one non-interactive session in a sandboxed workspace
(``agentloop.sandbox``) with a deadline, then an optional check command in the same workspace, and
returns what happened. Every LLM call the harness makes goes through the attempt's proxy, so it is
recorded with exact token ids like any agent's.

::

    @al.rollout
    async def agent(task: dict, llm: al.LLM) -> float:
        result = await al.harness.run("codex", task["prompt"], llm, workspace=task["repo"],
                                      check="python -m pytest -q", timeout_s=900)
        return 1.0 if result.check is not None and result.check.exit_code == 0 else 0.0

The harnesses are npm packages at pinned versions (``specs.HARNESSES``), installed by
``make harnesses`` under ``.venv/harness`` (or ``AGENTLOOP_HARNESS_PREFIX``; a binary on PATH is the
last resort). Inside the sandbox the harness reaches only the proxy's port (``network='none'`` with
the port bridged), its HOME is the workspace's ``.home``, and the node install and the harness
prefix are lent read-only.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from agentloop.harness.specs import HARNESSES, HarnessSpec, without_v1
from agentloop.logging import get_logger
from agentloop.resources import LLM
from agentloop.sandbox import Limits, RunResult, Sandbox, SandboxConfig, loopback_port
from agentloop.sandbox._files import Source
from agentloop.sandbox.errors import SandboxArgumentError, SandboxUnavailableError

log = get_logger("agentloop.harness")

__all__ = ["HARNESSES", "HarnessResult", "HarnessSpec", "harness_binary", "run", "without_v1"]

DEFAULT_CONTEXT_WINDOW = 32768  # what a harness is told the model holds (Codex plans its turns by it)


class HarnessResult(BaseModel):
    """One harness session: its run, the check after it, the files read back and its final answer."""

    harness: str = Field(description="codex, claude or opencode")
    run: RunResult = Field(description="the harness's own process: exit code, output, limits, isolation")
    check: RunResult | None = Field(default=None, description="the check command's run, when one was given")
    files: dict[str, str] = Field(default_factory=dict, description="workspace files read back (collect)")
    final_message: str | None = Field(default=None, description="the harness's last answer, when readable")

    @property
    def ok(self) -> bool:
        """The harness exited 0 within its deadline (and the check passed, when there was one)."""
        checked = self.check is None or self.check.exit_code == 0
        return self.run.exit_code == 0 and not self.run.timed_out and checked


def harness_prefix() -> Path:
    """Where ``make harnesses`` installs the pinned CLIs (``AGENTLOOP_HARNESS_PREFIX`` overrides)."""
    return Path(os.environ.get("AGENTLOOP_HARNESS_PREFIX") or Path(sys.prefix) / "harness")


def harness_binary(name: str) -> Path:
    """The installed binary of harness ``name``, or a clear error saying how to install it."""
    spec = _spec(name)
    pinned = harness_prefix() / "node_modules" / ".bin" / spec.binary
    found = pinned if pinned.exists() else shutil.which(spec.binary)
    if found is None:
        raise SandboxUnavailableError(
            f"harness {name!r} is not installed: run `make harnesses` (npm install {spec.npm_package} under "
            f"{harness_prefix()}), or set AGENTLOOP_HARNESS_PREFIX to an npm prefix that holds it"
        )
    return Path(found)


def _spec(name: str) -> HarnessSpec:
    if not isinstance(name, str) or name not in HARNESSES:
        raise SandboxArgumentError(f"harness must be one of {sorted(HARNESSES)}, got {name!r}")
    return HARNESSES[name]


def _prompt(task: object) -> str:
    if isinstance(task, str):
        prompt = task
    elif isinstance(task, Mapping) and isinstance(task.get("prompt"), str):
        prompt = task["prompt"]
    else:
        raise SandboxArgumentError(
            f"task must be the prompt (a str) or a dict with a 'prompt' str, got {type(task).__name__}"
        )
    if not prompt.strip():
        raise SandboxArgumentError("the task's prompt is empty")
    return prompt


def _config(
    spec: HarnessSpec, binary: Path, llm: LLM, base: SandboxConfig | None, timeout_s: float
) -> SandboxConfig:
    """The sandbox a harness runs in: only the proxy's port leads out; node and the harness lent
    read-only (the binary's real install: the pinned prefix, or wherever PATH found it). Without
    ``base``: the harness's address space, and CPU seconds for a session of ``timeout_s`` on 2 cores."""
    if base is None:
        limits = Limits(timeout_s=timeout_s, memory_mb=spec.memory_mb, cpu_s=max(60, int(2 * timeout_s)))
        base = SandboxConfig(limits=limits)
    config = base.with_node()
    real = Path(os.path.realpath(binary))
    modules = next((p for p in real.parents if p.name == "node_modules"), None)
    # the npm prefix (the package and its optional native binaries), else the binary's own folder
    lend = real.parent if modules is None else modules.parent
    binds = tuple(dict.fromkeys((*config.ro_binds, lend)))
    ports = tuple(dict.fromkeys((*config.loopback_ports, loopback_port(llm.base_url))))
    path = tuple(dict.fromkeys((str(binary.parent), *config.path)))
    return config.model_copy(update={"ro_binds": binds, "loopback_ports": ports, "path": path})


async def run(
    name: str,
    task: str | Mapping[str, object],
    llm: LLM,
    *,
    workspace: Source = None,
    check: str | Sequence[str] | None = None,
    collect: Sequence[str] = (),
    timeout_s: float = 600.0,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    sandbox: SandboxConfig | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    home_files: Mapping[str, str] | Callable[[str], Mapping[str, str]] | None = None,
) -> HarnessResult:
    """Run harness ``name`` (``codex``, ``claude``, ``opencode``) on ``task`` (the prompt, or a dict
    with ``prompt``) against ``llm`` (the attempt's proxy: ``llm.base_url`` on 127.0.0.1) in a new
    sandbox made from ``workspace`` (a directory or tarball copied in, a ``GitSnapshot``, or None).

    ``check`` runs in the same workspace after the harness (a test command: its result is the usual
    reward); ``collect`` names workspace files read back as text. ``timeout_s`` bounds the harness's
    session (the check gets the sandbox's own limit); ``sandbox`` replaces the default config (its
    limits, backend); the proxy's port is always bridged in. ``args`` are the harness's own options
    for this run, e.g. Claude Code's ``["--system-prompt", text, "--tools", "Bash"]`` (a shorter prompt
    for a small model's context); ``env`` adds variables to the harness's environment (over the
    spec's); ``home_files`` are more files for the harness's HOME (paths relative to it), written after
    the spec's config: a mapping, or a function of the sandbox's working directory that returns one
    (Claude Code keeps a session under ``.claude/projects/<cwd with '/' as '-'>/``, so a session to
    ``--resume`` depends on it). A harness that fails, hangs or is killed is in the result (``ok``
    False), not raised; a harness that is not installed raises.
    """
    spec = _spec(name)
    prompt = _prompt(task)
    if not isinstance(llm, LLM):
        raise SandboxArgumentError(f"llm must be an al.LLM (the attempt's), got {type(llm).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise SandboxArgumentError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 1:
        raise SandboxArgumentError(f"context_window must be an int >= 1, got {context_window!r}")
    extra = _strings("args", args)
    extra_env = _env(env)
    fixed_files = _files(home_files) if home_files is not None and not callable(home_files) else {}
    binary = harness_binary(name)
    config = _config(spec, binary, llm, sandbox, float(timeout_s))
    async with Sandbox.open(workspace, config=config) as sb:
        home = f"{sb.workdir}/{config.home}"
        extra_files = _files(home_files(sb.workdir)) if callable(home_files) else fixed_files
        for path, text in {**spec.files(llm, context_window), **extra_files}.items():
            await sb.write_file(f"{config.home}/{path}", text, mode=0o600)
        argv = spec.argv(prompt, llm, home, sb.workdir, extra)
        argv[0] = str(binary)
        log.info("harness_started", harness=name, isolation=sb.isolation, extra_args=len(extra))
        done = await sb.run(argv, env={**spec.env(llm, home), **extra_env}, timeout_s=timeout_s)
        last = await _read(sb, f"{config.home}/last_message.txt")
        checked = await sb.run(check) if check is not None else None
        files: dict[str, str] = {}
        for path in collect:
            read = await _read(sb, path)
            if read is not None:
                files[path] = read
    result = HarnessResult(
        harness=name,
        run=done,
        check=checked,
        files=files,
        final_message=spec.final_message(done.stdout, last),
    )
    log.info(
        "harness_finished",
        harness=name,
        exit_code=done.exit_code,
        timed_out=done.timed_out,
        check=None if checked is None else checked.exit_code,
        wall_s=round(done.usage.wall_s, 2),
    )
    return result


def _strings(what: str, values: Sequence[str]) -> list[str]:
    if isinstance(values, str | bytes) or not all(isinstance(v, str) for v in values):
        raise SandboxArgumentError(
            f"{what} must be a sequence of str (one per argument), got {values!r:.200}"
        )
    return list(values)


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()
    ):
        raise SandboxArgumentError(
            f"env must map variable names (str, no '=') to str values, got {env!r:.200}"
        )
    return dict(env)


def _files(files: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(files, Mapping) or not all(
        isinstance(k, str) and k and not k.startswith("/") and isinstance(v, str) for k, v in files.items()
    ):
        raise SandboxArgumentError(
            f"home_files must map paths relative to HOME (str, not absolute) to str contents, got {files!r:.200}"
        )
    return dict(files)


async def _read(sb: Sandbox, path: str) -> str | None:
    try:
        return (await sb.read_file(path)).decode(errors="replace")
    except (FileNotFoundError, SandboxArgumentError, OSError):
        return None
