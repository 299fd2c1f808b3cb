"""A local server speaking the Tinker API, so that the official ``tinker`` SDK (and tinker-cookbook's
training loops) train and sample on agentloop's model, engine and trainer pieces (docs/tinker.md).

    _proto.py    the protobuf messages of the wire, by hand
    wire.py      the JSON request bodies; forward_backward's data checked
    losses.py    cross_entropy, importance_sampling, ppo
    futures.py   submissions answered at once, results polled (retrieve_future)
    training.py  a LoRA training model with Adam (the trainer's pieces, handed in)
    sampling.py  sampling snapshots of weights on one TorchEngine
    service.py   sessions, models, sampling sessions, checkpoints
    app.py       the HTTP routes (Starlette)
    server.py    engine + service + HTTP server, started and stopped together
"""

from agentloop.tinker.app import CLIENT_CONFIG, build_app
from agentloop.tinker.losses import LOSS_INPUTS, LossError, compute_loss
from agentloop.tinker.server import TinkerServer
from agentloop.tinker.service import NotFound, TinkerService
from agentloop.tinker.training import TrainerParts, TrainingModel
from agentloop.tinker.wire import WireError

__all__ = [
    "CLIENT_CONFIG",
    "LOSS_INPUTS",
    "LossError",
    "NotFound",
    "TinkerServer",
    "TinkerService",
    "TrainerParts",
    "TrainingModel",
    "WireError",
    "build_app",
    "compute_loss",
]
