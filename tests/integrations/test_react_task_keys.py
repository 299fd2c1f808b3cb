"""The task keys ReactAgentLoop reads, as its docstring and the README document them."""

from __future__ import annotations

from typing import Any

import pytest

from integrations.langgraph import ReactAgentLoop


class Loop(ReactAgentLoop):
    def reward(self, task: Any, final_state: Any) -> float:
        return 0.0


USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize(
    ("task", "messages"),
    [
        ("What is 2 + 3?", USER),
        ({"question": "What is 2 + 3?", "answer": 5}, USER),  # other keys are left to reward()
        ({"prompt": "What is 2 + 3?"}, USER),
        (
            {"messages": [{"role": "system", "content": "Be brief."}, *USER]},
            [{"role": "system", "content": "Be brief."}, *USER],
        ),
        ({"messages": USER, "question": "ignored"}, USER),  # messages first
    ],
)
def test_documented_task_forms_become_graph_input(task: Any, messages: list[dict[str, str]]) -> None:
    assert Loop().graph_input(task) == {"messages": messages}


def test_other_tasks_are_refused_naming_the_keys() -> None:
    with pytest.raises(
        ValueError, match=r"'messages' .* or 'question' / 'prompt' .*got \['answer', 'text'\]"
    ):
        Loop().graph_input({"text": "What is 2 + 3?", "answer": 5})
    doc = ReactAgentLoop.__doc__ or ""
    assert all(key in doc for key in ('task["messages"]', 'task["question"]', 'task["prompt"]'))
