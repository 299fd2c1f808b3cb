"""What one sandboxed command gave back: ``RunResult`` and its ``ResourceUsage``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LimitHit", "ResourceUsage", "RunResult"]

# Which limit ended a run, when one did. An exhausted memory or process limit does not end a run
# by itself (the allocation or fork fails and the program decides), so it is not named here.
LimitHit = Literal["timeout", "cpu_time", "file_size", "disk"]


class ResourceUsage(BaseModel):
    """What a run used. CPU and RSS come from the launcher inside the sandbox (rusage of every reaped
    process): sandboxed code could forge them, so they are for reports, never for decisions."""

    model_config = ConfigDict(frozen=True)

    wall_s: float = Field(description="seconds from start to the last byte of output (host clock)")
    cpu_user_s: float | None = Field(default=None, description="user CPU seconds of the whole process tree")
    cpu_system_s: float | None = Field(
        default=None, description="system CPU seconds of the whole process tree"
    )
    max_rss_kb: int | None = Field(default=None, description="largest resident set of one process, KiB")
    workspace_bytes: int | None = Field(
        default=None, description="workspace size after the run (blocks in use)"
    )


class RunResult(BaseModel):
    """One command's outcome. A failing, killed or truncated command is a result, not an exception."""

    model_config = ConfigDict(frozen=True)

    exit_code: int = Field(description="the command's exit status; 128 + N when signal N ended it")
    signal: int | None = Field(default=None, description="the signal that ended the command, if one did")
    stdout: str = Field(description="stdout as UTF-8 (bad bytes replaced), cut at limits.output_bytes")
    stderr: str = Field(description="stderr as UTF-8 (bad bytes replaced), cut at limits.output_bytes")
    stdout_bytes: int = Field(description="bytes the command wrote to stdout, kept or not")
    stderr_bytes: int = Field(description="bytes the command wrote to stderr, kept or not")
    stdout_truncated: bool = Field(
        default=False, description="stdout ends with a note that says how much was cut"
    )
    stderr_truncated: bool = Field(
        default=False, description="stderr ends with a note that says how much was cut"
    )
    timed_out: bool = Field(
        False, description="the wall-clock deadline passed and the process tree was killed"
    )
    limit_hit: LimitHit | None = Field(default=None, description="the limit that ended the run, when one did")
    usage: ResourceUsage = Field(description="time, CPU, memory and disk used")
    isolation: str = Field(description="bwrap, none (subprocess backend) or a container backend's name")

    @property
    def ok(self) -> bool:
        """Exit status 0 and no limit hit."""
        return self.exit_code == 0 and self.limit_hit is None

    @property
    def truncated(self) -> bool:
        """stdout or stderr was cut."""
        return self.stdout_truncated or self.stderr_truncated
