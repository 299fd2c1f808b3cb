"""Every ```python block of README.md runs as written.

Fast (every run of the suite), per block:
- no undefined names (ruff's pyflakes rules on the block alone: a block must import what it uses);
- the block runs top to bottom with every ``X.fit(agent, train, val_dataset=...)`` call replaced by a
  check of what it was given (the Trainer is constructed, so its config is validated; the agent is an
  ``al.Agent``; every task is JSON and, for a ``ReactAgentLoop``, turns into graph input), so a block
  that could not reach its training call fails here.

Slow (``-m slow``): each block runs as a script in a fresh folder, really training, with the tiny
test model and one short step substituted for the README's model and numbers (``TINY``); every
substituted text must be in the block, so a README edit cannot silently turn it into a long run.
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
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)

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
    return [f"block{i}-line{block.splitlines()[0][:30]}" for i, block in enumerate(BLOCKS)]


def test_the_readme_has_python_snippets() -> None:
    assert len(BLOCKS) >= 2, "README.md lost its ```python blocks (or the fence style this test reads)"


@pytest.mark.parametrize("block", BLOCKS, ids=_ids())
def test_snippet_defines_every_name_it_uses(block: str) -> None:
    from ruff.__main__ import find_ruff_bin

    out = subprocess.run(
        [find_ruff_bin(), "check", "--isolated", "--select", "F821,F822,F823,F401,F811",
         "--output-format", "concise", "--stdin-filename", "snippet.py", "-"],
        input=block, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, f"README snippet:\n{block}\nruff:\n{out.stdout}{out.stderr}"


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
    from trainer.ray_trainer import FitResult

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
    transformer = _CheckFit()
    tree = ast.fix_missing_locations(transformer.visit(ast.parse(block)))
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    namespace: dict[str, Any] = {"__name__": "readme_snippet", "__check_fit__": _check_fit}
    exec(compile(tree, "README.md snippet", "exec"), namespace)
    assert transformer.calls >= ("Trainer(" in block)  # a training snippet reached its fit call


@pytest.mark.parametrize("block", [b for b in BLOCKS if "Trainer(" in b])
def test_training_snippets_hold_what_the_slow_test_makes_tiny(block: str) -> None:
    missing = [text for text in TINY if text not in block]
    assert not missing, f"the slow README test substitutes {missing}, which this snippet no longer has"


@pytest.mark.slow
@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=_ids())
def test_snippet_trains_as_written_with_the_tiny_model(
    block: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
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
        # has a reward, and the run must stop with the one-line error that says so (trainer/fit_signal.py)
        last = out.stderr.strip().splitlines()[-1]
        assert "no learning signal" in last and "the judge failed on" in last, out.stderr[-5000:]
        return
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    if "Trainer(" in block:
        printed = [tmp_path / line.strip() for line in out.stdout.splitlines() if line.strip()]
        run_dirs = [d for d in printed if d.is_dir()]  # the snippet prints result.run_dir
        assert run_dirs and (run_dirs[-1] / "metrics.jsonl").is_file(), out.stdout


def _serve_curls() -> list[list[str]]:
    """The README's `curl` calls to `agentloop serve`, each split as a shell would."""
    import shlex

    text = README.read_text().replace("\\\n", " ")
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
    assert len(curls) >= 3, "the README's serve section lost its curl examples"
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


YAML_BLOCKS = re.findall(r"^```yaml\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("job", YAML_BLOCKS, ids=[f"yaml{i}" for i in range(len(YAML_BLOCKS))])
def test_the_job_file_loads_as_written(job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's job file, beside the files it names, loads with `agentloop train`'s loader from
    another working folder (its paths are relative to the file)."""
    from agentloop.commands.train import load_job

    if "agent: verifiers:" in job:  # needs verifiers' own virtualenv: tests/integrations/test_verifiers.py
        pytest.skip("a verifiers job loads only where verifiers 0.4.0 is installed (make frameworks)")
    folder = tmp_path / "capitals"
    folder.mkdir()
    (folder / "job.yaml").write_text(job)
    (folder / "agent.py").write_text(BLOCKS[0].split("\n\n\ntasks = ")[0])  # the openai agent, no training
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
