"""The training loop of ``Trainer.fit``: steps, validation, waiting, stopping, the worker's load and checkpoints, the result."""
