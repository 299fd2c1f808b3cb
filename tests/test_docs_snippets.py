"""Every ```python block of README.md and of the docs pages (docs/*.md) runs as written.

Fast (every run of the suite), per block:
- no undefined names (ruff's pyflakes rules on the block alone: a block must import what it uses);
- the block runs top to bottom with every ``X.fit(agent, train, val_dataset=...)`` call replaced by a
  check of what it was given (the Trainer is constructed, so its config is validated; the agent is an
  ``al.Agent``; every task is JSON and, for a ``ReactAgentLoop``, turns into graph input), so a block
  that could not reach its training call fails here.

Slow (``-m slow``): each block runs as a script in a fresh folder, really training, with the tiny
test model and one short step substituted for the README's model and numbers (``TINY``); every
substituted text must be in the block, so a docs edit cannot silently turn it into a long run.

Also: the README's `curl` calls to `agentloop serve` work, every ```yaml job file loads with `agentloop
train`'s loader, and the "your own agent" files are the same in README.md, docs/your-agent.md and
examples/own_agent/. A block that cannot run here (it needs a service this test does not start) is
preceded by the line ``<!-- snippet: skip REASON -->`` and skipped with that reason.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SOURCES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # README.md and every docs page
SKIP = re.compile(r"<!-- snippet: skip (.+?) -->\s*$")
# pages whose blocks talk to a server this test does not start: checked for undefined names, not run
RUN_ELSEWHERE = {
    "docs/tinker.md": "the Tinker SDK against a running `agentloop tinker` server: tests/tinker runs that path",
}


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(where, block) of every ```lang block of the sources; ``where`` is ``file:line``."""
    found = []
    for path in SOURCES:
        lines = path.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.rstrip("\n") != f"```{lang}":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            block = "".join(lines[i + 1 : end])
            skip = next((m for m in (SKIP.search(x) for x in lines[max(0, i - 2) : i]) if m), None)
            page = path.relative_to(ROOT).as_posix()
            where = f"{page}:{i + 1}"
            found.append((where, block) if skip is None else (where, f"# skip: {skip.group(1)}\n"))
    return found


PY = _blocks("python")
BLOCKS = [block for _, block in PY]

# README text -> what the slow run uses instead ({tiny} is the tiny model's folder)
TINY = {
    '"smollm2-135m-instruct"': "{tiny}",
    '"n": 4': '"n": 2',
    '"total_training_steps": 20': '"total_training_steps": 1',
    '"max_response_length": 64': '"max_response_length": 8',
}
# and, where a snippet has it: the judge's answer budget (a random model's answer is never valid JSON, so
# every judge request runs to max_tokens, three tries a group: 1024 tokens took 331 s of one run)
TINY_WHERE_PRESENT = {'on_failure="skip",': 'on_failure="skip", max_tokens=64,'}
SNIPPET_TIMEOUT_S = 480  # one tiny step + a tiny validation; the whole run, imports and Ray start included


def _ids() -> list[str]:
    return [f"{where}-{block.splitlines()[0][:30]}" for where, block in PY]


def _skip_marked(block: str, run: bool = False) -> None:
    """Skip a block marked ``<!-- snippet: skip REASON -->``; with ``run``, also a block of a page whose
    code needs a server (``RUN_ELSEWHERE``)."""
    if block.startswith("# skip: "):
        pytest.skip(block.removeprefix("# skip: ").strip())
    page = next((where.rsplit(":", 1)[0] for where, b in PY if b == block), "")
    if run and page in RUN_ELSEWHERE:
        pytest.skip(f"{page}: {RUN_ELSEWHERE[page]}")


def test_the_readme_and_docs_have_python_snippets() -> None:
    in_readme = [where for where, _ in PY if where.startswith("README.md:")]
    assert in_readme, "README.md lost its ```python block (or the fence style this test reads)"
    assert len(PY) - len(in_readme) >= 5, "the docs pages lost their ```python blocks"


@pytest.mark.parametrize("block", BLOCKS, ids=_ids())
def test_snippet_defines_every_name_it_uses(block: str) -> None:
    _skip_marked(block)
    from ruff.__main__ import find_ruff_bin

    out = subprocess.run(
        [find_ruff_bin(), "check", "--isolated", "--select", "F821,F822,F823,F401,F811",
         "--output-format", "concise", "--stdin-filename", "snippet.py", "-"],
        input=block, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, f"snippet:\n{block}\nruff:\n{out.stdout}{out.stderr}"


class _CheckFit(ast.NodeTransformer):
    """``R.fit(args)`` -> ``__check_fit__(R, args)``: evaluates the receiver and arguments, trains nothing."""

    calls = 0

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "fit":
            self.calls += 1
            return ast.Call(
                ast.Name("__check_fit__", ast.Load()), [node.func.value, *node.args], node.keywords
            )
        return node


def _check_fit(trainer: Any, agent: Any, train: Any, val_dataset: Any = None, reward: Any = None) -> Any:
    import agentloop as al
    from integrations.langgraph import ReactAgentLoop
    from trainer import Trainer
    from trainer.fit.trainer import FitResult

    assert isinstance(trainer, Trainer), f".fit is called on a {type(trainer).__name__}, not a Trainer"
    assert isinstance(agent, al.Agent), f"the agent is a {type(agent).__name__}, not an al.Agent"
    assert reward is None or isinstance(reward, al.RewardJudge), f"reward is a {type(reward).__name__}"
    tasks = list(train) + list(val_dataset or [])
    assert len(train) >= trainer.config.data.train_batch_size, "fewer tasks than data.train_batch_size"
    for task in tasks:
        json.dumps(task)  # a task is stored as JSON
        if isinstance(agent, ReactAgentLoop):
            assert agent.graph_input(task)["messages"], task
    return FitResult(run_dir=trainer.config.trainer.run_dir, steps=0)


@pytest.mark.parametrize("block", BLOCKS, ids=_ids())
def test_snippet_runs_up_to_training(block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_marked(block, run=True)
    transformer = _CheckFit()
    tree = ast.fix_missing_locations(transformer.visit(ast.parse(block)))
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    namespace: dict[str, Any] = {"__name__": "readme_snippet", "__check_fit__": _check_fit}
    exec(compile(tree, "docs snippet", "exec"), namespace)
    assert transformer.calls >= ("Trainer(" in block)  # a training snippet reached its fit call


@pytest.mark.parametrize("block", [b for b in BLOCKS if "Trainer(" in b])
def test_training_snippets_hold_what_the_slow_test_makes_tiny(block: str) -> None:
    missing = [text for text in TINY if text not in block]
    assert not missing, f"the slow snippet test substitutes {missing}, which this snippet no longer has"


@pytest.mark.slow
@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=_ids())
def test_snippet_trains_as_written_with_the_tiny_model(
    block: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    _skip_marked(block, run=True)
    script = block
    for text, tiny in TINY.items():
        script = script.replace(text, json.dumps(str(tiny_model_dir)) if tiny == "{tiny}" else tiny)
    for text, tiny in TINY_WHERE_PRESENT.items():
        script = script.replace(text, tiny)
    (tmp_path / "snippet.py").write_text(script)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=SNIPPET_TIMEOUT_S,
    )  # fmt: skip
    if "judge_reward(" in block and out.returncode != 0:
        # a random model's verdicts are never valid JSON: every group fails (on_failure="skip"), no step
        # has a reward, and the run must stop with the one-line error that says so (trainer/fit/learning_signal.py)
        last = out.stderr.strip().splitlines()[-1]
        assert "no learning signal" in last and "the judge failed on" in last, out.stderr[-5000:]
        return
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    if "Trainer(" in block:
        printed = [tmp_path / line.strip() for line in out.stdout.splitlines() if line.strip()]
        run_dirs = [d for d in printed if d.is_dir()]  # the snippet prints result.run_dir
        assert run_dirs and (run_dirs[-1] / "metrics.jsonl").is_file(), out.stdout


def _serve_curls() -> list[list[str]]:
    """The docs' `curl` calls to `agentloop serve` (README.md and docs/*.md), each split as a shell would."""
    import shlex

    text = "\n".join(path.read_text() for path in SOURCES).replace("\\\n", " ")
    return [
        shlex.split(line)
        for line in text.splitlines()
        if line.startswith("curl ") and "localhost:8000" in line
    ]


async def test_the_serve_sections_curl_calls_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    import anyio
    import httpx
    from transformers import AutoTokenizer

    from agentloop.proxy.server import Proxy
    from agentloop.store.sqlite import SQLiteStore
    from tests.proxy.engines import EchoEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    curls = _serve_curls()
    assert len(curls) >= 3, "the serve page (docs/serving.md) lost its curl examples"
    store = SQLiteStore(tmp_path / "agentloop-serve.db")
    answers = []
    try:  # `agentloop serve` with the default model: a Proxy on a SQLite store, the model's folder name
        async with Proxy(EchoEngine(tokenizer), store, model_name="smollm2-135m-instruct") as proxy:
            async with httpx.AsyncClient(timeout=20) as http:
                for argv in curls:
                    url = next(a for a in argv if a.startswith("localhost:8000")).replace(
                        "localhost:8000", proxy.url
                    )
                    headers = dict(h.split(": ", 1) for flag, h in itertools.pairwise(argv) if flag == "-H")
                    body = next((d for flag, d in itertools.pairwise(argv) if flag == "-d"), None)
                    with anyio.fail_after(30):
                        if body is None:
                            resp = await http.get(url, headers=headers)
                        else:
                            resp = await http.post(url, content=body, headers=headers)
                    assert resp.status_code == 200, (argv, resp.text)
                    answers.append(resp.json())
    finally:
        await store.close()
    session = answers[-1]  # GET /v1/sessions/chat-1
    assert session["session_id"] == "chat-1" and len(session["calls"]) == 1
    assert session["calls"][0]["prompt_ids"] and [r["value"] for r in session["rewards"]] == [1.0]


# the job files: the ```yaml blocks with an `agent:` key (a block of config keys alone is no job file)
JOBS = [(where, job) for where, job in _blocks("yaml") if re.search(r"^agent:", job, flags=re.M)]
OWN_AGENT = next(block for block in BLOCKS if block.startswith("# agent.py\n"))


@pytest.mark.parametrize("job", [job for _, job in JOBS], ids=[where for where, _ in JOBS])
def test_the_job_file_loads_as_written(job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job file of the docs, beside the files it names, loads with `agentloop train`'s loader from
    another working folder (its paths are relative to the file)."""
    from agentloop.commands.train import load_job

    if "agent: verifiers:" in job:  # needs verifiers' own virtualenv: tests/integrations/test_verifiers.py
        pytest.skip("a verifiers job loads only where verifiers 0.4.0 is installed (make frameworks)")
    folder = tmp_path / "capitals"
    folder.mkdir()
    (folder / "job.yaml").write_text(job)
    (folder / "agent.py").write_text(OWN_AGENT)  # the "your own agent" agent.py
    (folder / "tasks.jsonl").write_text(
        "\n".join(json.dumps({"question": "1 + 1?", "answer": "2"}) for _ in range(8))
    )
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("agent", None)  # the previous block's agent.py, imported from another folder
    loaded = load_job(Path("capitals/job.yaml"))
    assert len(loaded.train) == 8 and loaded.val is None
    import agentloop as al

    assert isinstance(loaded.agent, al.Agent)
    assert isinstance(loaded.reward, al.RewardJudge) == ("\nreward:" in job)  # a reward.judge section
    assert loaded.config.trainer.total_training_steps == 20 and loaded.config.data.train_batch_size == 8


# ---------------------------------------------------------------- the pages themselves


def _block(path: Path, lang: str, first_line: str) -> str:
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)
    found = [b for b in blocks if b.splitlines()[0] == first_line]
    assert len(found) == 1, f"{path.name} must have one ```{lang} block starting {first_line!r}"
    return found[0]


def test_the_own_agent_is_the_same_in_the_readme_the_docs_and_examples() -> None:
    own = ROOT / "examples" / "own_agent"
    for page in (README, ROOT / "docs" / "your-agent.md"):
        assert _block(page, "python", "# agent.py") == (own / "agent.py").read_text(), page.name
        assert _block(page, "yaml", "# job.yaml") == (own / "job.yaml").read_text(), page.name
        command = _block(page, "bash", "# tasks.jsonl: one JSON task a line").splitlines()[1]
        assert command.endswith(" > tasks.jsonl"), command
        code = shlex_split(command.removesuffix(" > tasks.jsonl"))[-1]  # python -c '...'
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout == (own / "tasks.jsonl").read_text(), f"{page.name}'s tasks.jsonl command"


def shlex_split(command: str) -> list[str]:
    import shlex

    return shlex.split(command)


def test_the_readme_is_a_landing_page() -> None:
    """Issue 45: at most ~200 lines, none over 200 characters; the rest lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move sections into docs/"
    long = [f"{i + 1}: {len(line)}" for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists() -> None:
    """mkdocs --strict fails on a nav entry without its page, but only notes a page left out of the nav."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    docs = ROOT / "docs"
    pages = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    optional = _config_reference_module().OPTIONAL_PAGES  # in the nav before the page is written
    assert sorted(set(pages) - set(nav)) == [], "docs pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages) - optional) == [], "nav entries without a page"


def _config_reference_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_ref", ROOT / "docs" / "gen_config_ref.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_has_every_key_of_the_models() -> None:
    """The generated reference (docs/gen_config_ref.py, an mkdocs hook) holds every leaf key of
    TrainerConfig with its default, and the page has the marker the hook replaces."""
    from trainer import TrainerConfig

    gen = _config_reference_module()
    text = gen.render()
    assert gen.MARKER in (ROOT / "docs" / "configuration.md").read_text()
    keys = [row[0] for row in gen.rows(TrainerConfig)]
    assert len(keys) > 100 and "actor_rollout_ref.actor.optim.lr" in keys
    assert all(f"| `{key}` |" in text for key in keys)
    assert "| `actor_rollout_ref.actor.optim.lr` | float | `1e-06` |" in text
    assert "| `critic.optim.lr` | float | `1e-05` |" in text  # a section's default factory sets it
    assert "| `online.sessions_per_update` |" in text and "| `reward.judge.rubric` |" in text
