"""``import_object(spec)``: an object named by an import path, one syntax for every place that takes one.

Accepted (the union of what ``agentloop runner --agent``, a job file's ``agent``/``train_data``, a
tool registry's ``class`` and pickled agents accepted before there was one function)::

    package.module:attr.sub     a module, then attributes (the unambiguous form)
    package.module.attr         no colon: the longest importable prefix is the module
    path/to/file.py:attr        a file, imported from its own folder (so its sibling modules import
                                too); a relative path is relative to ``base``, else the working folder

Every failure is an ImportObjectError that names what was expected and what came: a spec of
another shape, a missing file or module, an error raised while importing (type, message, file and
line), or a missing attribute.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from agentloop.errors import ImportObjectError

__all__ = ["import_object"]

FORMS = "package.module:name, package.module.name or path/to/file.py:name"


def import_object(
    spec: str, what: str = "import path", *, base: Path | None = None, search_cwd: bool = False
) -> Any:
    """The object ``spec`` names (see the module docstring for the accepted forms).

    ``what`` starts every error message (``--agent``, ``tools.yaml: tools[0]: class``). ``base``: the
    folder a relative file path is relative to and where modules are looked up first (a job file's
    folder). ``search_cwd``: also look modules up in the working folder, as ``python -m`` does (the
    CLI sets it; a library call leaves ``sys.path`` as it is).
    """
    if not isinstance(spec, str):
        raise ImportObjectError(f"{what} must be a string ({FORMS}), got {type(spec).__name__}: {spec!r}")
    module_name, colon, attr = spec.rpartition(":")
    if not colon and spec.endswith(".py"):
        raise ImportObjectError(
            f"{what} {spec!r} names a file but not the object in it; write {spec}:name ({FORMS})"
        )
    dotted = spec.split(".")
    if colon:
        well_formed = bool(module_name) and all(attr.split("."))
    else:
        well_formed = len(dotted) > 1 and all(dotted)
    if not well_formed:
        raise ImportObjectError(f"{what} must look like module:object ({FORMS}), got {spec!r}")
    if colon and module_name.endswith(".py"):
        module = _import_file((base or Path.cwd()) / module_name, spec, what)
        return _attribute(module, module_name, attr, spec, what)
    if search_cwd and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: agents in the working folder are found
    if base is not None and str(base) not in sys.path:
        sys.path.insert(0, str(base))
    if colon:
        module = _import_module(module_name, spec, what, base, search_cwd)
        return _attribute(module, module_name, attr, spec, what)
    # package.module.attr: the longest prefix that is a module, the rest attributes
    for cut in range(len(dotted) - 1, 0, -1):
        candidate = ".".join(dotted[:cut])
        try:
            module = _import_module(candidate, spec, what, base, search_cwd, missing_ok=cut > 1)
        except ModuleNotFoundError:
            continue  # not a module: its parent may hold the rest as attributes
        return _attribute(module, candidate, ".".join(dotted[cut:]), spec, what)
    raise AssertionError("unreachable: the one-part prefix raises ImportObjectError")  # pragma: no cover


def _attribute(module: ModuleType, module_name: str, attr: str, spec: str, what: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportObjectError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def _import_file(path: Path, spec: str, what: str) -> ModuleType:
    if not path.is_file():
        raise ImportObjectError(f"{what} {spec!r}: file {str(path)!r} does not exist")
    folder, name = str(path.resolve().parent), path.stem
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = _import_module(name, spec, what, None, False)
    found = Path(getattr(module, "__file__", "") or "")
    if found.resolve() != path.resolve():
        raise ImportObjectError(
            f"{what} {spec!r}: a module named {name!r} is already imported from {str(found)!r}; "
            f"rename {path.name}"
        )
    return module


def _import_module(
    name: str, spec: str, what: str, base: Path | None, search_cwd: bool, *, missing_ok: bool = False
) -> ModuleType:
    """``importlib.import_module(name)``; ``missing_ok``: a ModuleNotFoundError for ``name`` itself (or a
    parent package) propagates as it is, so the caller can try a shorter prefix."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            if missing_ok:
                raise
            where = [str(base)] if base is not None else []
            if search_cwd:
                where.append(f"the working folder ({os.getcwd()})")
            places = f"in {', '.join(where)} or on the Python path" if where else "on the Python path"
            raise ImportObjectError(f"{what} {spec!r}: no module named {exc.name!r} {places}") from None
        raise ImportObjectError(f"{what} {spec!r}: importing {name!r} failed: {_raised_at(exc)}") from exc
    except Exception as exc:  # the module's own code failed: say what and where
        raise ImportObjectError(f"{what} {spec!r}: importing {name!r} failed: {_raised_at(exc)}") from exc


def _raised_at(exc: BaseException) -> str:
    """``Type: message (file.py, line N)``: the innermost frame outside Python's import machinery."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    return f"{text} ({frames[-1].filename}, line {frames[-1].lineno})" if frames else text
