"""How each harness is pointed at a rollout's proxy: the files it reads, its command line and its
environment. Versions are pinned (``Makefile``'s ``harnesses`` target installs them); a harness
binary of another version may send requests the proxy was not checked against.

Each spec writes its config under HOME (the sandbox's writable ``.home``), never the host's, and
turns off what would leave the sandbox (telemetry, auto-update) or ask a human (approvals): the
sandbox, not the harness, is the security boundary here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from agentloop.resources import LLM


class HarnessSpec(Protocol):
    """One harness: its pinned npm package, its binary, and how a run is set up."""

    @property
    def name(self) -> str:
        """The name ``run`` takes."""
        ...

    @property
    def npm_package(self) -> str:
        """``name@version``, pinned."""
        ...

    @property
    def binary(self) -> str:
        """The executable under ``node_modules/.bin``."""
        ...

    @property
    def memory_mb(self) -> int:
        """Address space one process needs (the sandbox's RLIMIT_AS): node's V8 runs in 2 GiB; Bun's
        JavaScriptCore reserves tens of GiB it never touches and dies of an illegal instruction under less."""
        ...

    def files(self, llm: LLM, context_window: int) -> dict[str, str]:
        """Config files to write, relative to HOME."""
        ...

    def argv(self, prompt: str, llm: LLM, home: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
        """The command line (``binary`` first) for one non-interactive session on ``prompt``; ``extra``
        (the caller's own options) goes where the CLI takes options, never between an option and its value
        (Claude Code's variadic ``--tools`` would swallow a prompt after it, so there it goes last)."""
        ...

    def env(self, llm: LLM, home: str) -> dict[str, str]:
        """Environment beyond HOME and PATH (the sandbox passes nothing of the host's)."""
        ...

    def final_message(self, stdout: str, last_message: str | None) -> str | None:
        """The harness's final answer from its output, when it can be read."""
        ...


def _key(llm: LLM) -> str:
    return llm.api_key or "EMPTY"  # the CLIs refuse to start without a key; the proxy may need none


def without_v1(base_url: str) -> str:
    """``http://h:p/rollout/r/attempt/a/v1`` -> ``http://h:p/rollout/r/attempt/a`` (Anthropic clients add
    ``/v1/messages`` themselves)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True)
class Codex:
    """OpenAI Codex CLI over the Responses API (``wire_api = "responses"``)."""

    name: str = "codex"
    npm_package: str = "@openai/codex@0.169.0"
    binary: str = "codex"
    memory_mb: int = 4096

    def files(self, llm: LLM, context_window: int) -> dict[str, str]:
        config = (
            f"model = {json.dumps(llm.model)}\n"
            'model_provider = "agentloop"\n'
            f"model_context_window = {int(context_window)}\n"
            'approval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\n'  # the rollout's sandbox is the boundary
            "[model_providers.agentloop]\n"
            'name = "agentloop"\n'
            f"base_url = {json.dumps(llm.base_url)}\n"
            'wire_api = "responses"\n'
            'env_key = "AGENTLOOP_API_KEY"\n'
        )
        return {".codex/config.toml": config}

    def argv(self, prompt: str, llm: LLM, home: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
        return [
            self.binary,
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--color",
            "never",
            "-C",
            workdir,
            "-o",
            f"{home}/last_message.txt",
            *extra,
            prompt,
        ]

    def env(self, llm: LLM, home: str) -> dict[str, str]:
        return {"CODEX_HOME": f"{home}/.codex", "AGENTLOOP_API_KEY": _key(llm), "NO_COLOR": "1"}

    def final_message(self, stdout: str, last_message: str | None) -> str | None:
        return last_message.strip() if last_message else None


@dataclass(frozen=True)
class ClaudeCode:
    """Anthropic's Claude Code over the Messages API (``ANTHROPIC_BASE_URL`` without ``/v1``)."""

    name: str = "claude"
    npm_package: str = "@anthropic-ai/claude-code@2.1.332"
    binary: str = "claude"
    memory_mb: int = 4096

    def files(self, llm: LLM, context_window: int) -> dict[str, str]:
        return {
            ".claude.json": json.dumps(
                {"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}
            )
        }

    def argv(self, prompt: str, llm: LLM, home: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
        return [
            self.binary,
            "-p",
            prompt,
            "--output-format",
            "json",
            "--model",
            llm.model,
            "--dangerously-skip-permissions",
            *extra,  # last: a variadic option (--tools, --allowed-tools) would take a prompt after it
        ]

    def env(self, llm: LLM, home: str) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": without_v1(llm.base_url),
            "ANTHROPIC_API_KEY": _key(llm),
            "ANTHROPIC_MODEL": llm.model,
            "ANTHROPIC_SMALL_FAST_MODEL": llm.model,  # its side calls (titles) go to the same model
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "IS_SANDBOX": "1",
        }

    def final_message(self, stdout: str, last_message: str | None) -> str | None:
        try:
            out = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else None
        except json.JSONDecodeError:
            return None
        return out.get("result") if isinstance(out, dict) and isinstance(out.get("result"), str) else None


@dataclass(frozen=True)
class OpenCode:
    """opencode over Chat Completions (an ``@ai-sdk/openai-compatible`` provider)."""

    name: str = "opencode"
    npm_package: str = "opencode-ai@1.18.33"
    binary: str = "opencode"
    memory_mb: int = 131072

    def files(self, llm: LLM, context_window: int) -> dict[str, str]:
        config = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "provider": {
                "agentloop": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "agentloop",
                    "options": {"baseURL": llm.base_url, "apiKey": _key(llm)},
                    "models": {
                        llm.model: {"name": llm.model, "limit": {"context": context_window, "output": 4096}}
                    },
                }
            },
            "model": f"agentloop/{llm.model}",
        }
        return {".config/opencode/opencode.json": json.dumps(config, indent=2)}

    def argv(self, prompt: str, llm: LLM, home: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
        return [self.binary, "run", "--model", f"agentloop/{llm.model}", *extra, prompt]

    def env(self, llm: LLM, home: str) -> dict[str, str]:
        return {"XDG_CONFIG_HOME": f"{home}/.config", "OPENCODE_DISABLE_AUTOUPDATE": "1", "NO_COLOR": "1"}

    def final_message(self, stdout: str, last_message: str | None) -> str | None:
        return stdout.strip() or None


HARNESSES: dict[str, HarnessSpec] = {spec.name: spec for spec in (Codex(), ClaudeCode(), OpenCode())}
