"""Subcommands of the ``agentloop`` CLI, one module each; ``register(sub)`` adds them to a parser."""

from __future__ import annotations

import argparse

from agentloop.commands import bench, inspect, rollback, runner, serve, sft, tinker, train


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for module in (train, sft, serve, rollback, inspect, bench, runner, tinker):
        module.register(sub)
