"""Run folders and stores that only their owner can read: folders 0700, files 0600.

A run folder holds the task data, every rollout and its tokens (``store.db``), the config and the
checkpoints; ``agentloop-serve.db`` holds every app conversation. With the default umask they came out
0755 / 0644: readable by every local user. Here:

- :func:`private_dir` makes a folder (and its missing parents, with the default mode) and sets it 0700;
- :func:`private_file` creates a file 0600 before a library opens it (SQLite gives its ``-wal`` and
  ``-shm`` files the mode of the database file), or takes group and other bits off one that exists;
- :func:`write_private_text` writes a whole file created 0600;
- :func:`tighten` takes group and other bits off one file or folder that exists, :func:`tighten_tree`
  off everything under a folder (files other code
  wrote: checkpoints, plots, logs, the final model).

Only what this user owns is changed (a store opened read-only from someone else's folder is left as
it is), and a filesystem that refuses ``chmod`` is not an error: the call logs and goes on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentloop.logging import get_logger

__all__ = ["private_dir", "private_file", "tighten", "tighten_tree", "write_private_text"]

log = get_logger("agentloop.private_files")

_SHARED_BITS = 0o077  # group and other: read, write, execute


def tighten(path: str | Path) -> None:
    """Take group and other bits off ``path`` if it exists, is ours and is not a link."""
    path = Path(path)
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or not st.st_mode & _SHARED_BITS:
            return
        path.chmod(stat.S_IMODE(st.st_mode) & ~_SHARED_BITS)
    except FileNotFoundError:
        return
    except OSError as exc:  # a filesystem without permissions (some mounts): nothing more to do
        log.warning("cannot make private", path=str(path), error=repr(exc)[:200])


def private_dir(path: str | Path) -> Path:
    """``path`` as a folder only its owner can enter (0700), made if missing."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    tighten(path)
    return path


def private_file(path: str | Path) -> Path:
    """``path`` as a file only its owner can read (0600): created empty if missing, else its group
    and other bits taken off."""
    path = Path(path)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        tighten(path)
    return path


def write_private_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8), the file created 0600 (an existing one tightened)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    tighten(path)


def tighten_tree(root: str | Path) -> None:
    """Take group and other bits off ``root`` and everything under it (links are not followed)."""
    root = Path(root)
    tighten(root)
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            tighten(Path(folder) / name)
