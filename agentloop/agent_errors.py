"""An agent's error as its author wants to read it: their own frames, the library's folded away.

The runner stores every failed attempt's full traceback (``ErrorInfo.traceback``, Python's own text).
That text is mostly frames of agentloop, anyio, openai and the standard library; the line that broke
is one frame of the user's file. Everything here works on the stored *text*, so the console (the
runner's first failure of each kind), the trainer's ``N x Error at file:line`` summary and
``agentloop inspect RUN --errors`` all read the same thing, also for attempts of an earlier run::

    Traceback (most recent call last):
      [4 frames of agentloop, anyio hidden]
      File "/home/me/capitals/agent.py", line 14, in agent
        return score(task, text)
      File "/home/me/capitals/agent.py", line 6, in score
        return float(text == task["answr"])
                             ~~~~^^^^^^^^^
    KeyError: 'answr'

A frame is the library's when its file lies in site-packages/dist-packages, in the standard library,
or in agentloop's own packages (agentloop, trainer, integrations); anything else is the user's.
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Frame", "fold_traceback", "parse_frames", "user_location"]

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?$')
_OWN_PACKAGES = ("agentloop", "trainer", "integrations")  # this distribution's import packages


@dataclass(frozen=True)
class Frame:
    """One ``File "...", line N, in func`` entry of a traceback, with the lines printed under it."""

    file: str
    line: int
    func: str
    body: tuple[str, ...] = ()  # the source line and any ~~~^^^ markers, as printed


def _library_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    here = Path(__file__).resolve().parent.parent  # the folder holding agentloop/ (and trainer/)
    roots |= {str(here / name) for name in _OWN_PACKAGES}
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots if r))


_ROOTS = _library_roots()


def is_library_file(file: str) -> bool:
    """True for frames the user did not write (see the module docstring); ``<string>`` and the like
    count as the user's (code they exec'd)."""
    if file.startswith("<frozen ") or f"{os.sep}site-packages{os.sep}" in file:
        return True
    if f"{os.sep}dist-packages{os.sep}" in file:
        return True
    return file.startswith(_ROOTS)


def _library_name(file: str) -> str:
    """A short name for the package a library frame belongs to (``anyio``, ``agentloop``, ``python``)."""
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if marker in file:
            rest = file.split(marker, 1)[1]
            return rest.split(os.sep, 1)[0].removesuffix(".py")
    here = Path(__file__).resolve().parent.parent
    for name in _OWN_PACKAGES:
        if file.startswith(str(here / name) + os.sep):
            return name
    for root in _ROOTS:  # the standard library: its module (json, asyncio, concurrent)
        if file.startswith(root):
            return file[len(root) :].split(os.sep, 1)[0].removesuffix(".py")
    return "python"


def parse_frames(text: str) -> list[Frame]:
    """Every frame of a traceback's text, outermost first (chained exceptions one after the other)."""
    frames: list[Frame] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FRAME.match(lines[i])
        i += 1
        if m is None:
            continue
        body = []
        while i < len(lines) and lines[i].startswith("    "):
            body.append(lines[i])
            i += 1
        frames.append(Frame(m["file"], int(m["line"]), m["func"] or "?", tuple(body)))
    return frames


def _display_path(file: str) -> str:
    """``file`` relative to the working folder when it lies under it, else as it is."""
    try:
        return os.path.relpath(file) if Path(file).is_relative_to(Path.cwd()) else file
    except ValueError:  # another drive (Windows)
        return file


def user_location(text: str | None) -> str | None:
    """``agent.py:6 in score``: the innermost frame of the user's code in a traceback, or None when
    every frame is the library's (or there is no traceback)."""
    if not text:
        return None
    last = None
    for frame in parse_frames(text):
        if not is_library_file(frame.file):
            last = frame
    if last is None:
        return None
    return f"{_display_path(last.file)}:{last.line} in {last.func}"


def fold_traceback(text: str) -> str:
    """The traceback with each run of library frames replaced by one ``[N frames of a, b hidden]`` line;
    the user's frames, the headers and the exception lines stay as Python printed them."""
    out: list[str] = []
    hidden: list[str] = []

    def flush() -> None:
        if hidden:
            names = ", ".join(dict.fromkeys(hidden))
            out.append(f"  [{len(hidden)} frame{'s' if len(hidden) != 1 else ''} of {names} hidden]")
            hidden.clear()

    lines = text.rstrip("\n").splitlines()
    i = 0
    while i < len(lines):
        m = _FRAME.match(lines[i])
        if m is None:
            flush()
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].startswith("    "):
            j += 1
        if is_library_file(m["file"]):
            hidden.append(_library_name(m["file"]))
        else:
            flush()
            out.extend(lines[i:j])
        i = j
    flush()
    return "\n".join(out)
