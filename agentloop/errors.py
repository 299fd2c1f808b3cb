"""The one exception tree of agentloop.

::

    AgentLoopError
    ├── NotFoundError            an id (rollout, attempt, resources) the store does not know
    ├── InvalidTransitionError   a lifecycle change the state machine forbids
    │   └── StaleAttemptError    a write from an attempt that is no longer the latest one
    ├── AgentError               an agent returned something that is not a reward
    ├── RolloutContextError      a rollout-only helper called outside a rollout
    ├── EngineError              the inference engine failed
    │   ├── ContextLengthExceededError  the prompt does not fit the model's context
    │   └── RequestAbortedError         the request was aborted before it finished
    ├── ModelResolutionError     a model alias, folder or package could not be found
    ├── ImportObjectError        an import path (package.module:name) names nothing importable (also an ImportError)
    ├── StoreUnavailableError    the HTTP store could not be reached
    ├── InvalidRequestError      a bad argument to a store call (also a ValueError)
    ├── ConfigError              a trainer config key or value is not valid (also a ValueError)
    ├── EmptyBatchError          no usable training sample in a batch, or in several steps of a fit (also a ValueError)
    ├── TrainerTimeoutError      a wait in the training loop passed its deadline (also a TimeoutError)
    ├── JudgeError               an LLM judge gave no usable scores after its retries (agentloop/judge/)
    ├── ToolError                a tool was defined, looked up or called wrongly
    │   ├── ToolDefinitionError  a function, class or YAML entry cannot become a tool
    │   ├── ToolNotFoundError    a tool name the registry does not know (also a KeyError)
    │   └── ToolArgumentError    the model's arguments do not fit the tool (also a ValueError)
    ├── SandboxError             a sandbox (agentloop.sandbox) could not be created, used or cleaned up
    │   ├── SandboxUnavailableError  the backend asked for cannot run here (bwrap missing, user namespaces
    │   │                            off, no Python for the launcher), or a harness is not installed
    │   └── SandboxArgumentError     a bad argument: command, env, timeout, workspace path (also a ValueError)
    └── VerifiersEpisodeError    a verifiers environment's episode failed (integrations/verifiers.py)

Validation errors on public calls are pydantic's ``ValidationError``; they name the field.

Beside the tree, for the ``agentloop`` command only::

    ValueError
    └── UsageError               a mistake in what the user gave a command (argument, job file, path,
                                 import); agentloop/cli.py prints it in one line and exits 2

``UsageError`` is not an ``AgentLoopError`` and not in ``__all__`` (not part of ``import agentloop``'s
API); the commands raise it, and ``agentloop.cli.UsageError`` is the same class.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "AgentLoopError",
    "ConfigError",
    "ContextLengthExceededError",
    "EmptyBatchError",
    "EngineError",
    "ImportObjectError",
    "InvalidRequestError",
    "InvalidTransitionError",
    "JudgeError",
    "ModelResolutionError",
    "NotFoundError",
    "RequestAbortedError",
    "RolloutContextError",
    "SandboxArgumentError",
    "SandboxError",
    "SandboxUnavailableError",
    "StaleAttemptError",
    "StoreUnavailableError",
    "ToolArgumentError",
    "ToolDefinitionError",
    "ToolError",
    "ToolNotFoundError",
    "TrainerTimeoutError",
    "VerifiersEpisodeError",
]


class AgentLoopError(Exception):
    """Base of every error agentloop raises on purpose."""


class NotFoundError(AgentLoopError, KeyError):
    """An id the store does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "not found"


class InvalidTransitionError(AgentLoopError):
    """A lifecycle change that the state machine forbids."""


class StaleAttemptError(InvalidTransitionError):
    """A write from an attempt that has been superseded or has already finished."""


class AgentError(AgentLoopError):
    """An agent broke its contract (for example it returned a non-reward value)."""


class RolloutContextError(AgentLoopError):
    """A helper that needs the current rollout was called outside one."""


class EngineError(AgentLoopError):
    """The inference engine failed to serve a request."""


class ContextLengthExceededError(EngineError):
    """The prompt (plus max_tokens where required) does not fit the model's context window."""


class RequestAbortedError(EngineError):
    """The request was aborted (by `abort` or by a weight update) before it finished."""


class ModelResolutionError(AgentLoopError):
    """A model alias, folder or package could not be resolved."""


class ImportObjectError(AgentLoopError, ImportError):
    """An import path (``package.module:name``, ``package.module.name``, ``file.py:name``) is malformed or
    names nothing importable; the message gives the accepted forms or what failed (see agentloop.importing)."""


class StoreUnavailableError(AgentLoopError):
    """The HTTP store could not be reached or answered with a server error."""


class InvalidRequestError(AgentLoopError, ValueError):
    """A store call got a bad argument (wrong type, unknown enum value, not JSON-serialisable).

    Over HTTP, a server-side validation failure comes back as this error.
    """


class ToolError(AgentLoopError):
    """A tool was defined, looked up or called wrongly."""


class ToolDefinitionError(ToolError):
    """A function, class or YAML entry cannot become a tool (bad signature, duplicate name, ...)."""


class ToolNotFoundError(ToolError, KeyError):
    """A tool name the registry does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "tool not found"


class ToolArgumentError(ToolError, ValueError):
    """The arguments a model gave a tool do not match its parameters; the message is for the model."""


class ConfigError(AgentLoopError, ValueError):
    """A trainer config (or an algorithm name) is not valid; the message names the dotted key."""


class EmptyBatchError(AgentLoopError, ValueError):
    """No usable training sample: no triplets came, or every one was dropped (the message says why).

    A fit raises it when ``trainer.max_steps_without_signal`` steps in a row had no usable attempt
    (no reward, the agent raised, prompt too long, empty ids): the message counts the attempts by kind."""


class TrainerTimeoutError(AgentLoopError, TimeoutError):
    """A wait in the training loop (rollouts, runner, engine, update, weight sync, checkpoint) passed its
    deadline; the message names what it waited for and the ``trainer.timeouts`` key that sets it."""


class JudgeError(AgentLoopError):
    """An LLM judge (``al.judge_reward``) gave no usable scores for a group after its retries, or its
    endpoint refused the request; the message shows the judge's last answer and why it was refused."""


class SandboxError(AgentLoopError):
    """A sandbox could not be created, used or cleaned up; the message says what and how to fix it.
    A command that fails, times out or hits a limit is not one: ``Sandbox.run`` returns a result."""


class SandboxUnavailableError(SandboxError):
    """The backend asked for cannot run here, or a harness is not installed; the message gives the fix."""


class SandboxArgumentError(SandboxError, ValueError):
    """An argument to a sandbox call is not valid; the message says what was expected and what came."""


class VerifiersEpisodeError(AgentLoopError):
    """A verifiers environment's episode (``integrations.verifiers.VerifiersAgent``) ended with errors: its
    harness exited non-zero, a tool or reward method raised, a timeout. The first line names the first error;
    below it, each of the environment's own errors with its traceback."""


class UsageError(ValueError):
    """A mistake in what the user gave a command; the message says what came and how to fix it."""
