"""Online training from live app traffic (``agentloop serve --train CONFIG.yaml``), with a promotion gate:
the trainer and its config section live in ``trainer/online/trainer.py``."""

from trainer.online.trainer import (
    Evaluator,
    OnlineConfig,
    OnlineTrainer,
    gate_proxy,
    jsonl_evaluator,
    online_trainer_config,
    session_metrics,
)

__all__ = [
    "Evaluator",
    "OnlineConfig",
    "OnlineTrainer",
    "gate_proxy",
    "jsonl_evaluator",
    "online_trainer_config",
    "session_metrics",
]
