"""The results page's figures, read from benchmarks/results/*.json as the site builds (never typed by hand).

docs/results.md holds the prose; three kinds of mark in it are replaced by what the result files say:

- ``{{ FILE:KEY }}`` or ``{{ FILE:KEY|SPEC }}``: one value of ``benchmarks/results/FILE`` at the dotted
  ``KEY`` (``trainer.speedup``; a list index is a number: ``runs.0.accuracy_after``). ``SPEC`` is a Python
  format spec (``.1%``, ``.2f``) or ``min`` (seconds shown as minutes, one decimal);
- ``<!-- result FILE: KEY KEY ... -->``: the file's header on one line (command, commit, machine, card,
  date) and a table of the keys' values;
- ``<!-- results-index -->``: a table of every result file with its header, so none is left off the page.

A mark that names a missing file or key, or a value that is not a number, text or list of them, raises
:class:`ResultsPageError`: ``make docs`` fails rather than print a stale or empty figure. The files' header
is benchmarks/result_file.py's.

Two uses, as docs/gen_config_ref.py: an MkDocs hook (``hooks:`` in mkdocs.yml) that renders any page
holding a mark, and ``python docs/gen_results.py``, which prints docs/results.md rendered. It reads JSON
only (no mkdocs, no agentloop), so the tests render it without the docs tools.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
HEADER = ("benchmark", "command", "commit", "machine", "card", "date")  # benchmarks/result_file.py's
INDEX = "<!-- results-index -->"
VALUE = re.compile(r"\{\{\s*([\w.\-]+\.json):([^|}\s]+)(?:\|([^}\s]+))?\s*\}\}")
SECTION = re.compile(r"<!--\s*result\s+([\w.\-]+\.json)\s*:\s*(.*?)\s*-->", re.S)


class ResultsPageError(ValueError):
    """A mark on the page names a result file, a key or a format that the files do not have."""


@functools.cache
def load(name: str) -> dict[str, Any]:
    """``benchmarks/results/NAME`` parsed, its header checked."""
    path = RESULTS / name
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in RESULTS.glob("*.json")))
        raise ResultsPageError(f"no result file {name!r} in {RESULTS} (have: {have})")
    doc = json.loads(path.read_text())
    missing = [k for k in HEADER if k not in doc]
    if missing:
        raise ResultsPageError(f"{name} lacks the header fields {missing} (benchmarks/result_file.py)")
    return doc  # type: ignore[no-any-return]


def lookup(name: str, key: str) -> Any:
    """The value at dotted ``key`` in result file ``name``; a number segment indexes a list."""
    value: Any = load(name)
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise ResultsPageError(f"{name} has no {key!r} (stopped at {part!r})")
    return value


def number(x: float) -> str:
    """A figure as the page shows it: integers whole, others to 4 significant digits (1,000 and up: 0.1)."""
    if isinstance(x, bool) or isinstance(x, int):
        return f"{x:,}" if not isinstance(x, bool) else str(x).lower()
    if abs(x) >= 1000:
        return f"{x:,.1f}"
    return f"{x:.4g}"


def cell(value: Any, spec: str | None = None, where: str = "") -> str:
    """One value as Markdown table text (pipes escaped)."""
    if spec is not None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ResultsPageError(f"{where}: format {spec!r} needs a number, the file has {value!r}")
        text = f"{value / 60:.1f}" if spec == "min" else format(value, spec)
    elif value is None:
        text = "null"
    elif isinstance(value, bool | int | float):
        text = number(value)
    elif isinstance(value, str):
        text = value
    elif isinstance(value, list) and all(isinstance(v, bool | int | float | str) for v in value):
        text = ", ".join(number(v) if not isinstance(v, str) else v for v in value)
    else:
        raise ResultsPageError(f"{where} is a {type(value).__name__}: name a key below it")
    return " ".join(text.split()).replace("|", "\\|")


def machine_text(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    memory = f", {m['memory_gb']} GiB" if m.get("memory_gb") else ""
    return f"{m.get('cpu', 'unknown')}{cores}{memory}"


def header_line(name: str) -> str:
    doc = load(name)
    card = doc["card"] or "no GPU"
    return (
        f"`{name}` · {cell(doc['date'])} · {cell(card)} · {cell(machine_text(doc))} · "
        f"commit `{doc['commit']}` · `{cell(doc['command'])}`"
    )


def section(name: str, keys: list[str]) -> str:
    """The file's header line and a two-column table of ``keys``."""
    rows = [f"| `{key}` | {cell(lookup(name, key), where=f'{name}:{key}')} |" for key in keys]
    return "\n".join([header_line(name), "", "| figure | value |", "| --- | --- |", *rows])


def index() -> str:
    """Every result file: benchmark, card or CPU, date, commit."""
    lines = ["| file | benchmark | card / CPU | date | commit |", "| --- | --- | --- | --- | --- |"]
    for path in sorted(RESULTS.glob("*.json")):
        doc = load(path.name)
        where = doc["card"] or machine_text(doc)
        lines.append(
            f"| `{path.name}` | {cell(doc['benchmark'])} | {cell(where)} | {cell(doc['date'])} | `{doc['commit']}` |"
        )
    return "\n".join(lines)


def render(markdown: str) -> str:
    """``markdown`` with every mark replaced by the result files' values (module docstring)."""

    def value(m: re.Match[str]) -> str:
        name, key, spec = m.group(1), m.group(2), m.group(3)
        return cell(lookup(name, key), spec, where=f"{name}:{key}")

    def table(m: re.Match[str]) -> str:
        return section(m.group(1), m.group(2).split())

    out = SECTION.sub(table, markdown)
    out = VALUE.sub(value, out)
    return out.replace(INDEX, index())


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The MkDocs hook: a page with a mark gets the files' values (the others pass through)."""
    if INDEX in markdown or VALUE.search(markdown) or SECTION.search(markdown):
        load.cache_clear()  # `mkdocs serve` rebuilds: read the files as they are now
        return render(markdown)
    return markdown


if __name__ == "__main__":
    print(render(PAGE.read_text()), end="")
