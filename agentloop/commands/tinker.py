"""``agentloop tinker --model M``: a local server speaking the Tinker API (docs/tinker.md).

The official SDK drives it unchanged::

    export TINKER_API_KEY=tml-local-...          # the key the server takes and the SDK sends
    agentloop tinker --model smollm2-135m-instruct --port 8100
    python -c "import tinker; tinker.ServiceClient(base_url='http://127.0.0.1:8100')..."

The key (the SDK wants one starting with ``tml-``) comes from ``--api-key-file``, ``--api-key``,
``$AGENTLOOP_TINKER_API_KEY`` or ``$TINKER_API_KEY``, in that order; without one the server does not start.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import anyio

from agentloop import event_loop
from agentloop.errors import UsageError

KEY_ENV = "AGENTLOOP_TINKER_API_KEY"
SDK_KEY_ENV = "TINKER_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tinker", help="serve a model over the Tinker API (the tinker SDK and tinker-cookbook)"
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, local HF folder or hub id")
    p.add_argument(
        "--model-name",
        default=None,
        help="the name clients pass as base_model and see in answers (default: --model); the model's "
        "folder and --model are accepted too",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--api-key-file", type=Path, default=None, help=f"file holding the key (or ${KEY_ENV})")
    p.add_argument(
        "--api-key", default=None, help="the key as env:NAME, file:PATH or the key itself (visible in `ps`)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where save_state checkpoints go (kept across restarts); default a temporary folder",
    )
    p.add_argument("--max-batch-size", type=int, default=32, help="the engine's most concurrent sequences")
    p.add_argument(
        "--max-models", type=int, default=4,
        help="training models held at once, over every client (each is a copy of the model, its gradients and "
        "Adam's moments in memory); a client past it gets a 400 saying so",
    )  # fmt: skip
    p.set_defaults(func=run)


def trainer_parts() -> Any:
    """The trainer's model, LoRA, log-prob and checkpoint functions as ``TrainerParts`` (imported here,
    lazily: ``agentloop/`` itself never imports ``trainer/``)."""
    from pathlib import Path as _Path

    import torch

    from agentloop.tinker.training import TrainerParts
    from trainer.algorithms._logprobs import logprobs_from_logits
    from trainer.config import TrainerConfig
    from trainer.model._lora import merged_lora_weights, wrap_lora
    from trainer.model.policy_model import load_policy
    from trainer.run_folder.checkpoint import load_policy_state, save_policy

    def lora(model: torch.nn.Module, rank: int, alpha: int, targets: list[str]) -> torch.nn.Module:
        config = TrainerConfig.from_dict(
            {
                "actor_rollout_ref": {
                    "model": {"lora_rank": rank, "lora_alpha": alpha, "target_modules": targets}
                }
            }
        )
        return wrap_lora(model, config)

    def save(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, path: _Path) -> None:
        save_policy(model, opt, step, rank, path)

    return TrainerParts(
        load_policy=load_policy,
        wrap_lora=lora,
        merged_weights=merged_lora_weights,
        token_logprobs=logprobs_from_logits,
        save_state=save,
        load_state=load_policy_state,
    )


def read_tinker_key(args: argparse.Namespace) -> tuple[Any, str]:
    """The key and where it came from (module docstring); UsageError without one."""
    from agentloop.keys import read_key

    try:
        if args.api_key_file is not None:
            return read_key(f"file:{args.api_key_file}", "--api-key-file"), str(args.api_key_file)
        if args.api_key:
            if not args.api_key.startswith(("env:", "file:")):
                sys.stderr.write(
                    "agentloop tinker: note: a key on the command line is visible to every user (ps)\n"
                )
            return read_key(args.api_key, "--api-key"), "--api-key"
        for env in (KEY_ENV, SDK_KEY_ENV):
            if os.environ.get(env):
                return read_key(f"env:{env}", env), f"${env}"
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    raise UsageError(
        f"agentloop tinker needs an API key (the tinker SDK always sends one): set ${SDK_KEY_ENV} to a key "
        f"starting with 'tml-' (the SDK reads it too), or pass --api-key-file PATH"
    )


async def serve(args: argparse.Namespace) -> None:
    from agentloop.tinker import TinkerServer

    server = TinkerServer(
        args.model, trainer_parts(), [args.key], host=args.host, port=args.port, device=args.device,
        model_name=args.model_name, state_dir=args.state_dir,
        engine_kwargs={"max_batch_size": args.max_batch_size}, max_models=args.max_models,
    )  # fmt: skip
    url = await server.start()
    sys.stdout.write(
        f"agentloop tinker serving {server.model_name}; key {args.key_source}\n"
        f"  base URL:   {url}   (tinker.ServiceClient(base_url=..., api_key=...))\n"
        f"  checkpoints: {server.state_dir}\nCtrl-C to stop.\n"
    )
    sys.stdout.flush()
    try:
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await server.stop()


def run(args: argparse.Namespace) -> int:
    from agentloop.commands.serve import check_port_free

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch_size < 1:
        raise UsageError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_models < 1:
        raise UsageError(f"--max-models must be >= 1, got {args.max_models}")
    args.key, args.key_source = read_tinker_key(args)
    check_port_free(args.host, args.port)
    event_loop.run(serve, args)
    return 0
