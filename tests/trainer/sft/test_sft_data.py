"""SFT's data (trainer/sft/data.py) without a store; the filter on a recorded store is in test_sft.py."""

from __future__ import annotations

from trainer.sft.data import split_tasks


def test_the_split_holds_out_whole_tasks_deterministically() -> None:
    tasks = [f"t{i % 10}" for i in range(40)]  # 10 tasks, 4 attempts each
    train, val = split_tasks(tasks, 0.2, seed=3)
    assert (train, val) == split_tasks(tasks, 0.2, seed=3) and sorted(train + val) == list(range(40))
    assert len({tasks[i] for i in val}) == 2 and not {tasks[i] for i in val} & {tasks[i] for i in train}
    assert split_tasks(tasks, 0.2, seed=4) != (train, val)
    assert split_tasks(["only"] * 3, 0.5, seed=0) == ([0, 1, 2], [])  # one task: it trains
