"""Rewards from an LLM judge: the attempts at one task scored relative to each other (RULER-style).

::

    judge = al.judge_reward(rubric="...")                    # the trainer's served model judges
    judge = al.judge_reward(rubric="...", llm=al.LLM(base_url=..., model=..., api_key=...))  # any other
    Trainer(config).fit(agent, tasks, reward=judge)          # the agent returns None

One concept per module; the judge's public names are re-exported here:

- ``prompt``: the request for one group (rubric, task, trajectories) and the parsing of the answer
- ``cache``: ``Verdict`` and the verdict cache (memory + a JSON-lines file)
- ``reward``: ``RewardJudge`` (one group's request, retries, cache) and ``judge_reward``
- ``rollouts``: the trainer's hook: a step's finished rollouts grouped by task, judged, Reward spans
- ``config``: ``JudgeConfig``, the ``reward.judge`` section of an ``agentloop train`` job file

Imports go one way: ``prompt`` and ``cache`` import neither, ``rollouts`` uses ``prompt``, ``reward``
uses all three, ``config`` uses ``reward``.

With ``on_failure="skip"`` the trainer leaves a group the judge fails on unrewarded (its attempts
train on nothing, counted in ``judge/failed_groups`` and logged). Validation rollouts are judged the
same way (a group of ``val_kwargs.n`` attempts; with n = 1 an absolute score). ``agentloop train``
builds one from the job file's ``reward.judge`` section.

Traps: a judge call of the served model runs on the policy being trained (its verdicts change as it
learns) and competes with the agents for the engine; a small model is a poor judge (SmolLM2-135M often
does not answer in JSON at all; benchmarks/results/judge_agreement_cpu.json measures it).
"""

from __future__ import annotations

from agentloop.judge.cache import Verdict
from agentloop.judge.prompt import DEFAULT_RUBRIC, trajectory_messages
from agentloop.judge.reward import RewardJudge, judge_reward

__all__ = ["DEFAULT_RUBRIC", "RewardJudge", "Verdict", "judge_reward", "trajectory_messages"]
