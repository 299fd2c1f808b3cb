"""``agentloop serve --model M``: the engine and the OpenAI-compatible proxy for apps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio

from agentloop.cli import UsageError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve a model behind the recording OpenAI-compatible proxy")
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, local HF folder or hub id")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument(
        "--store", type=Path, default=Path("agentloop-serve.db"), help="SQLite file for the recorded calls"
    )
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    from agentloop.engine.models import load_engine
    from agentloop.proxy import Proxy
    from agentloop.store.sqlite import SQLiteStore

    engine = load_engine(args.model, device=args.device)
    store = SQLiteStore(args.store)
    proxy = Proxy(engine, store, host=args.host, port=args.port, api_key=args.api_key)
    await proxy.start()
    sys.stdout.write(
        f"agentloop proxy serving {args.model}\n"
        f"  OpenAI base URL (apps):   {proxy.session_base_url}\n"
        f"  per-attempt template:     {proxy.url_template}\n"
        f"  recorded calls:           {args.store}\nCtrl-C to stop.\n"
    )
    sys.stdout.flush()
    try:
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await proxy.stop()
            await engine.stop()
            await store.close()


def run(args: argparse.Namespace) -> int:
    """Serve until stopped: Ctrl-C or SIGTERM ends ``serve`` (the proxy, engine and store close in its
    ``finally``) and the CLI prints the one line that says so."""
    from agentloop.errors import ModelResolutionError

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    try:
        anyio.run(serve, args)
    except ModelResolutionError as exc:
        raise UsageError(f"--model: {exc}") from None
    return 0
