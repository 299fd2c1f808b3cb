"""benchmarks/results/*.json: each file one run behind benchmarks/result_file.py's header (no dated or
variant keys beside it: history goes to benchmarks/NOTES.md), every figure `agentloop bench --results` reads
is there, and docs/gen_results.py renders the results page from the files alone."""

from __future__ import annotations

import importlib.util
import json
import re
from datetime import datetime
from pathlib import Path
from types import ModuleType

import pytest

from agentloop.commands.bench import TARGETS, lookup
from benchmarks import result_file
from tests.benchmarks import BENCHMARKS

ROOT = BENCHMARKS.parent
FILES = sorted((BENCHMARKS / "results").glob("*.json"))
COMMIT = re.compile(r"^([0-9a-f]{7,40}(-dirty)?|unknown)$")
# a top-level key that names a date, an earlier or later run, a session or a card: a second run in the file
DATED_OR_VARIANT = re.compile(
    r"\d{4}[_-]\d{2}[_-]\d{2}"
    r"|^(runs?|sessions?|previous|earlier|before|after|older|second_run|same_session|same_day)_(?!dir$)"
    r"|^(before|after|previous|earlier|older|session|second_run)$"
    r"|(^|_)(previous|earlier|older|again)(_|$)|_(before|after)_"
    r"|(^|_)(\d+x)?h[12]00(_|$)",
    re.IGNORECASE,
)


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_results", ROOT / "docs" / "gen_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_result_files() -> None:
    assert len(FILES) >= 40, FILES


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_a_result_file_starts_with_the_fixed_header(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert list(doc)[: len(result_file.HEADER)] == list(result_file.HEADER), (
        f"{path.name}: the first keys must be {result_file.HEADER} (benchmarks/result_file.py writes them)"
    )
    assert isinstance(doc["benchmark"], str) and doc["benchmark"]
    assert isinstance(doc["command"], str) and doc["command"]
    assert COMMIT.match(doc["commit"]), (
        f"{path.name}: commit {doc['commit']!r} is not a hash[-dirty] or 'unknown'"
    )
    machine = doc["machine"]
    assert isinstance(machine, dict) and {"cpu", "cores", "memory_gb"} <= set(machine), machine
    assert machine["cores"] is None or machine["cores"] >= 1
    assert doc["card"] is None or (isinstance(doc["card"], str) and doc["card"])
    datetime.fromisoformat(doc["date"])  # a date, or a date and time, ISO 8601


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_a_result_file_holds_one_run(path: Path) -> None:
    doc = json.loads(path.read_text())
    variants = [k for k in doc if k not in result_file.HEADER and DATED_OR_VARIANT.search(k)]
    assert not variants, (
        f"{path.name} has dated or variant keys {variants}: a file holds one run; move earlier runs to "
        "benchmarks/NOTES.md, or a second current run to a file of its own"
    )


@pytest.mark.parametrize(
    ("key", "variant"),
    [("run_2026_11_28c_h200_all_three", True), ("before_2026_11_27_warm_up", True), ("previous_session", True),
     ("torch_before_rework", True), ("vllm_earlier_run_same_machine", True), ("rollout_h200_before", True),
     ("runs_same_day", True), ("same_session_16k_budget", True), ("second_run", True), ("actor_only_again", True),
     ("accuracy_before", False), ("accuracy_after", False), ("run_dir", False), ("runs", False),
     ("legs_sync_then_async", False), ("weight_sync_split", False)],
)  # fmt: skip
def test_the_variant_rule_tells_a_second_run_from_a_figure(key: str, variant: bool) -> None:
    assert bool(DATED_OR_VARIANT.search(key)) is variant


def test_every_figure_agentloop_bench_reads_is_a_number() -> None:
    for target in TARGETS:
        doc = json.loads((BENCHMARKS / "results" / target.result).read_text())
        value = lookup(doc, target.key)
        assert isinstance(value, int | float), f"{target.result}: {target.key} is {value!r}"


def test_the_results_page_is_rendered_from_the_files() -> None:
    gen = _renderer()
    page = gen.PAGE.read_text()
    text = gen.render(page)
    assert not gen.VALUE.search(text) and not gen.SECTION.search(text) and gen.INDEX not in text
    for path in FILES:  # the index lists every file; its header line is there for each file with a section
        assert f"| `{path.name}` |" in text, path.name
    named = {m.group(1) for m in gen.SECTION.finditer(page)}
    assert named == {p.name for p in FILES}, (
        f"files without a section: {sorted({p.name for p in FILES} - named)}"
    )
    doc = json.loads((BENCHMARKS / "results" / "demo_cpu.json").read_text())
    assert f"commit `{doc['commit']}`" in text  # the header, as the file has it
    assert gen.render("{{demo_cpu.json:accuracy_after|.1%}} in {{demo_cpu.json:wall_s|min}} min") == (
        f"{doc['accuracy_after']:.1%} in {doc['wall_s'] / 60:.1f} min"
    )


def test_a_mark_the_files_cannot_fill_fails_the_build() -> None:
    gen = _renderer()
    with pytest.raises(gen.ResultsPageError, match=r"demo_cpu.json has no 'accuracy_later'"):
        gen.render("{{demo_cpu.json:accuracy_later}}")
    with pytest.raises(gen.ResultsPageError, match=r"no result file 'nothing.json'"):
        gen.render("<!-- result nothing.json: ratio -->")
    with pytest.raises(gen.ResultsPageError, match=r"is a dict: name a key below it"):
        gen.render("{{demo_cpu.json:settings}}")
    with pytest.raises(gen.ResultsPageError, match=r"format '.1%' needs a number"):
        gen.render("{{demo_cpu.json:command|.1%}}")
