"""Load: 100 concurrent agents x 5 turns through the proxy into SQLite; all complete, memory is released."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.reliability.load import run_load
from tests.reliability.report import record


@pytest.mark.e2e
async def test_100_agents_x_5_turns(tmp_path: Path, tokenizer: Any) -> None:
    figures = await run_load(tokenizer, tmp_path / "load.db", agents=100, turns=5)
    assert figures["succeeded"] == figures["runner_succeeded"] == 100 and figures["lost_rollouts"] == 0
    assert figures["requests"] == 500
    assert figures["ledger_conversations_at_end"] > 0  # the ledger held the attempts ...
    assert figures["ledger_conversations_after_sweep"] == 0  # ... and released them once they finished
    assert figures["rss_growth_kb_per_rollout"] < 200, figures  # bounded: no per-rollout leak of note
    record("load", **figures)
