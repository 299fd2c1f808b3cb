"""``agentloop bench`` finds benchmarks/ from an installed package: a copy of agentloop outside the checkout
(as pip installs it) run from inside a checkout, with --dir, and with no checkout in reach."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop.cli import UsageError
from agentloop.commands.bench import find_benchmarks

ROOT = Path(__file__).resolve().parents[2]
FIGURE = "engine vs HF generate (CPU)"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """site-packages with a copy of agentloop and nothing else of the checkout."""
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copytree(ROOT / "agentloop", site / "agentloop", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _bench(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``agentloop bench --results --only engine_bench.py ARGS`` with the installed copy (-P: the working
    folder is not put on sys.path, as for the console script)."""
    code = (
        "import sys, agentloop, agentloop.cli\n"
        f"assert agentloop.__file__.startswith({str(site)!r}), agentloop.__file__\n"
        "sys.exit(agentloop.cli.main(sys.argv[1:]))\n"
    )
    argv = ["bench", "--results", "--only", "engine_bench.py", *args]
    return subprocess.run(
        [sys.executable, "-P", "-c", code, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(cwd)},
        timeout=120,
    )


def _figure_line(out: subprocess.CompletedProcess[str]) -> str:
    line = next((x for x in out.stdout.splitlines() if x.startswith(FIGURE)), None)
    assert line is not None, out.stdout + out.stderr
    return line


@pytest.mark.e2e
def test_installed_inside_a_checkout_reads_its_benchmarks(installed: Path) -> None:
    out = _bench(installed, ROOT / "examples")  # a folder below the checkout's root
    assert out.returncode in (0, 1), out.stderr  # 1: a figure misses its target; the table prints either way
    assert "n/a" not in _figure_line(out)


@pytest.mark.e2e
def test_installed_with_dir_from_anywhere(installed: Path, tmp_path: Path) -> None:
    out = _bench(installed, tmp_path, "--dir", str(ROOT / "benchmarks"))
    assert out.returncode in (0, 1), out.stderr
    assert "n/a" not in _figure_line(out)


@pytest.mark.e2e
def test_installed_with_no_checkout_says_how_to_fix_it(installed: Path, tmp_path: Path) -> None:
    out = _bench(installed, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "agentloop bench: error: no benchmarks/ folder found" in out.stderr
    assert f"none is in {tmp_path.resolve()}" in out.stderr and "pass --dir PATH/TO/benchmarks" in out.stderr
    out = _bench(installed, tmp_path, "--dir", str(tmp_path))
    assert out.returncode == 2 and "is not a benchmarks/ folder (it has no store_bench.py)" in out.stderr


def test_find_benchmarks_order(tmp_path: Path) -> None:
    assert (
        find_benchmarks(cwd=ROOT / "tests" / "commands") == ROOT / "benchmarks"
    )  # from the working folder up
    assert find_benchmarks(cwd=ROOT / "benchmarks" / "gpu") == ROOT / "benchmarks"
    assert find_benchmarks(cwd=tmp_path) == ROOT / "benchmarks"  # this package is imported from the checkout
    own = tmp_path / "mine" / "benchmarks"
    own.mkdir(parents=True)
    (own / "store_bench.py").write_text("")
    assert find_benchmarks(cwd=own.parent) == own  # the checkout you are in comes first
    assert find_benchmarks(Path(own)) == own
    with pytest.raises(UsageError, match="is not a benchmarks/ folder"):
        find_benchmarks(tmp_path)
