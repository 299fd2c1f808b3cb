"""benchmarks/result_file.py: the fixed header every result file starts with, built from this checkout and
this machine; a figure named as a header field refused; a real benchmark's --out file carries it."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks import result_file
from tests.benchmarks import BENCHMARKS

ROOT = BENCHMARKS.parent


def test_the_header_names_this_checkout_and_machine() -> None:
    head = result_file.header("demo", command="python benchmarks/demo.py --x 1", gpu=None, load=[1.0])
    assert list(head) == list(result_file.HEADER)
    assert head["benchmark"] == "demo" and head["command"] == "python benchmarks/demo.py --x 1"
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert head["commit"].removesuffix("-dirty") == rev.stdout.strip()
    machine = head["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["load"] == [1.0]
    assert machine["memory_gb"] is None or machine["memory_gb"] > 0
    assert head["card"] is None
    assert datetime.fromisoformat(head["date"]).utcoffset() is not None  # UTC, with its offset


def test_the_commit_outside_a_checkout_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(result_file, "ROOT", tmp_path)  # no .git here, as in a GPU machine's copy
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv(result_file.COMMIT_ENV, raising=False)
    assert result_file.commit() == "unknown"
    monkeypatch.setenv(result_file.COMMIT_ENV, "abc1234")
    assert result_file.commit() == "abc1234"


def test_the_command_is_written_from_the_checkout_root() -> None:
    argv = [str(BENCHMARKS / "store_bench.py"), "--workers", "1", "--out", "a b.json"]
    assert result_file.command_line(argv) == "python benchmarks/store_bench.py --workers 1 --out 'a b.json'"


def test_a_figure_named_as_a_header_field_is_refused(tmp_path: Path) -> None:
    head = result_file.header("demo", command="x", gpu=None)
    with pytest.raises(ValueError, match=r"figures \['machine'\] are named as header fields"):
        result_file.result(head, {"machine": "2-core", "ratio": 2.0})
    doc = result_file.result(head, {"ratio": 2.0})
    assert list(doc) == [*result_file.HEADER, "ratio"]
    result_file.write(tmp_path / "sub" / "r.json", doc)
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == doc
    with pytest.raises(ValueError, match=r"needs the header fields \['benchmark'"):
        result_file.write(tmp_path / "bad.json", {"ratio": 2.0})


@pytest.mark.e2e
def test_a_benchmark_writes_its_result_with_the_header(tmp_path: Path) -> None:
    out = tmp_path / "store.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "store_bench.py"), "--workers", "1", "--backends", "memory",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert json.loads(run.stdout) == doc  # what it prints is what it writes
    assert list(doc)[: len(result_file.HEADER)] == list(result_file.HEADER)
    assert doc["benchmark"] == "store_bench" and doc["card"] is None
    assert doc["command"] == f"python benchmarks/store_bench.py --workers 1 --backends memory --out {out}"
    assert doc["throughput"]["memory"]["1"] > 0
