"""``agentloop serve --model M``: the engine and the OpenAI-compatible proxy for apps."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from pydantic import SecretStr

from agentloop import event_loop
from agentloop.errors import UsageError

KEY_ENV = "AGENTLOOP_PROXY_API_KEY"  # an app key
ADMIN_KEY_ENV = "AGENTLOOP_ADMIN_KEY"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve a model behind the recording OpenAI-compatible proxy")
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="alias, local HF folder, run folder or hub id"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="most tokens (prompt + response) of one request; default: the model's own limit "
        "(max_position_embeddings, SmolLM2: 8192). Lower it to hold less KV cache per request",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--api-key-file",
        type=Path,
        action="append",
        default=[],
        help="file holding an app key (Authorization: Bearer KEY): it uses the model and owns the sessions "
        f"it creates; repeat for several apps; or set ${KEY_ENV}. Required when --host is not loopback",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="an app key as env:NAME, file:PATH, or the key itself (then visible to every user in `ps`: "
        f"prefer --api-key-file or ${KEY_ENV}); repeatable",
    )
    p.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="file holding the admin key: the admin routes (versions, rollback) and every session; or set "
        f"${ADMIN_KEY_ENV}. Without one the admin routes are off",
    )
    p.add_argument("--admin-key", default=None, help="the admin key as env:NAME or file:PATH (or the key)")
    p.add_argument(
        "--store",
        type=Path,
        default=Path("agentloop-serve.db"),
        help="SQLite store for the recorded app sessions (calls and rewards)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes that serve the rollouts' calls (the per-attempt routes); the engine stays in this one. "
        "0: all in this process",
    )
    p.add_argument(
        "--train",
        type=Path,
        default=None,
        metavar="CONFIG.yaml",
        help="also train online from the apps' rewarded sessions, with a promotion gate (trainer keys plus "
        "an `online:` section; see README)",
    )
    p.add_argument(
        "--run-dir", type=Path, default=None, help="with --train: where versions and promotions.jsonl go"
    )
    p.set_defaults(func=run)


def read_online_config(path: Path) -> dict[str, Any]:
    """The ``--train`` file as a dict; ``online.eval_tasks`` and a file ``online.eval_reward`` are
    taken relative to the file's folder."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--train {path}: cannot read it: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--train {path}: expected a mapping of config sections, got {type(raw).__name__}")
    online = raw.get("online") or {}
    if isinstance(online, dict) and isinstance(online.get("eval_tasks"), str):
        online["eval_tasks"] = str((path.parent / online["eval_tasks"]).resolve())
    reward = online.get("eval_reward") if isinstance(online, dict) else None
    if isinstance(reward, str) and reward.partition(":")[0].endswith(".py"):  # a file beside the config
        file, _, attr = reward.partition(":")
        online["eval_reward"] = f"{(path.parent / file).resolve()}:{attr}"
    return raw


async def _online(args: argparse.Namespace, proxy: Any, model_path: str, device: str) -> Any:
    """The OnlineTrainer for ``--train`` (its admin routes added to the proxy before it starts)."""
    from agentloop.proxy.admin import add_admin_routes
    from trainer.online import OnlineTrainer, jsonl_evaluator, online_trainer_config

    try:
        config, online = online_trainer_config(read_online_config(args.train), model_path, device)
    except ValueError as exc:
        raise UsageError(f"--train {args.train}: {exc}") from None
    evaluate = None
    if online.eval_tasks or online.eval_reward:
        if not (online.eval_tasks and online.eval_reward):
            raise UsageError(f"--train {args.train}: online.eval_tasks and online.eval_reward go together")
        evaluate = jsonl_evaluator(
            online.eval_tasks, online.eval_reward, max_tokens=online.eval_max_tokens,
            concurrency=online.eval_concurrency,
        )  # fmt: skip
    run_dir = args.run_dir or Path("runs") / "online" / time.strftime("%Y%m%d-%H%M%S")
    trainer = OnlineTrainer(proxy, config, online, model_path, run_dir, evaluate=evaluate)
    add_admin_routes(proxy.app, trainer, proxy.admin_key, bound_host=args.host)
    return trainer


async def serve(args: argparse.Namespace) -> None:
    from agentloop.device import pick_device
    from agentloop.engine.factory import load_engine
    from agentloop.engine.models import resolve_model
    from agentloop.proxy import Proxy
    from agentloop.store.sqlite import SQLiteStore

    try:
        engine = load_engine(args.model, device=args.device, **engine_options(args))
    except ValueError as exc:  # the engine refused its context or KV budget: say which flag
        raise UsageError(f"--max-context: {exc}") from None
    store = SQLiteStore(args.store)
    proxy = Proxy(
        engine, store, host=args.host, port=args.port, api_key=args.keys[0] if args.keys else None,
        app_keys=args.keys, admin_key=args.admin, workers=args.workers,
    )  # fmt: skip
    trainer = None
    if args.train is not None:
        trainer = await _online(args, proxy, str(resolve_model(args.model)), pick_device(args.device))
    await proxy.start()
    online = (
        f"  online training:          {trainer.online.sessions_per_update} rewarded sessions per update, "
        f"{'gate: ' + str(trainer.online.eval_tasks) if trainer.evaluate else 'no gate (every update served)'}; "
        f"run folder {trainer.run_dir}\n  admin:                    "
        + (
            f"{proxy.url}/v1/admin/versions, agentloop rollback --to N (admin key)\n"
            if args.admin is not None
            else f"off (no admin key: --admin-key-file PATH or ${ADMIN_KEY_ENV})\n"
        )
        if trainer is not None
        else ""
    )
    sys.stdout.write(
        f"agentloop proxy serving {args.model}; key {args.key_source}; {args.admin_source}\n"
        f"  OpenAI base URL (apps):   {proxy.session_base_url}\n"
        f"  per-attempt template:     {proxy.url_template}\n"
        + "".join(f"  worker {i} template:      {t}\n" for i, t in enumerate(proxy.worker_url_templates))
        + f"  model name:               {proxy.model_name}\n"
        f"  store (app sessions too): {args.store}\n{online}Ctrl-C to stop.\n"
    )
    sys.stdout.flush()
    try:
        if trainer is None:
            await anyio.sleep_forever()
        else:
            await trainer.run()
            await anyio.sleep_forever()  # online.max_updates reached: serve on
    finally:
        with anyio.CancelScope(shield=True):
            if trainer is not None:
                await trainer.close()
            await proxy.stop()
            await engine.stop()
            await store.close()


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_engine`` keywords that serve's flags set (none: the engine's defaults)."""
    return {} if args.max_context is None else {"max_context": args.max_context}


def check_max_context(args: argparse.Namespace) -> None:
    """``--max-context`` within [2, the model's limit], checked from the model's config before any
    weights load (the engine checks again, and against its KV budget)."""
    from agentloop.engine.models import model_context_limit, resolve_model

    n = args.max_context
    if n is None:
        return
    if n < 2:
        raise UsageError(f"--max-context must be >= 2 tokens, got {n}")
    limit = model_context_limit(resolve_model(args.model))
    if limit is not None and n > limit:
        raise UsageError(
            f"--max-context {n} is above the model's limit of {limit} tokens ({args.model}: "
            f"max_position_embeddings); pass at most {limit}, or leave the flag out for the model's full context"
        )


def run(args: argparse.Namespace) -> int:
    """Serve until stopped: Ctrl-C or SIGTERM ends ``serve`` (the proxy, engine and store close in its
    ``finally``) and the CLI prints the one line that says so."""
    from agentloop.errors import ModelResolutionError
    from agentloop.http_limits import is_loopback

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {args.workers}")
    args.keys, args.key_source = read_serve_keys(args)
    args.admin, args.admin_source = read_admin_key(args)
    if not args.keys and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address, so a key is required: pass --api-key-file PATH "
            f"or set ${KEY_ENV} (or serve on 127.0.0.1)"
        )
    check_port_free(args.host, args.port)  # before the model loads: a taken port is one line at once
    try:
        args.model = str(model_of_run_folder(args.model))
        check_max_context(args)
        event_loop.run(serve, args)  # on uvloop where installed
    except ModelResolutionError as exc:
        raise UsageError(f"--model: {exc}") from None
    return 0


def check_port_free(host: str, port: int) -> None:
    """UsageError when ``host:port`` cannot be bound (taken, or not an address of this machine)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} is not an address this machine can serve on ({exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is free
        try:
            sock.bind(address)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise UsageError(
                f"port {port} on {host} is already in use (another agentloop serve?): stop what listens "
                f"there or pass --port N (--port 0 picks a free one)"
                if taken
                else f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None


def model_of_run_folder(model: str) -> str | Path:
    """``model`` itself, or a training run folder's ``final_model/`` (said on stderr)."""
    from agentloop.engine.models import resolve_model

    if not (Path(model).expanduser() / "run.json").is_file():
        return model
    resolved = resolve_model(model)  # a run folder: its final_model/, or why not
    if resolved != Path(model).expanduser():
        sys.stderr.write(f"agentloop serve: {model} is a run folder; serving its trained model {resolved}\n")
    return resolved


def read_serve_keys(args: argparse.Namespace) -> tuple[list[SecretStr], str]:
    """The app keys from --api-key-file and --api-key (each repeatable), else $AGENTLOOP_PROXY_API_KEY,
    and where they came from (for the banner; a key itself is never printed)."""
    from agentloop.keys import read_key

    keys: list[SecretStr] = []
    sources: list[str] = []
    try:
        for path in args.api_key_file:
            keys.append(read_key(f"file:{path}", "--api-key-file"))  # type: ignore[arg-type]
            sources.append(str(path))
        for ref in args.api_key:
            if not ref.startswith(("env:", "file:")):
                sys.stderr.write(
                    "agentloop serve: note: a key on the command line is visible to every user (ps); "
                    f"prefer --api-key-file or ${KEY_ENV}\n"
                )
            key = read_key(ref, "--api-key")
            if key is None:
                raise ValueError("--api-key is empty")
            keys.append(key)
            sources.append("--api-key")
        if not keys and os.environ.get(KEY_ENV):
            keys.append(read_key(f"env:{KEY_ENV}", KEY_ENV))  # type: ignore[arg-type]
            sources.append(f"${KEY_ENV}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not keys:
        return [], "not required (loopback only)"
    what = "" if len(keys) == 1 else f"{len(keys)} app keys, "
    return keys, f"required ({what}from {', '.join(dict.fromkeys(sources))})"


def read_admin_key(args: argparse.Namespace) -> tuple[SecretStr | None, str]:
    """The admin key from --admin-key-file, --admin-key or $AGENTLOOP_ADMIN_KEY (in that order), and
    the banner's words for it. It must differ from every app key."""
    from agentloop.keys import read_key

    if args.admin_key_file is not None and args.admin_key:
        raise UsageError("give --admin-key-file or --admin-key, not both")
    try:
        if args.admin_key_file is not None:
            key, source = (
                read_key(f"file:{args.admin_key_file}", "--admin-key-file"),
                str(args.admin_key_file),
            )
        elif args.admin_key:
            if not args.admin_key.startswith(("env:", "file:")):
                sys.stderr.write(
                    "agentloop serve: note: a key on the command line is visible to every user (ps); "
                    f"prefer --admin-key-file or ${ADMIN_KEY_ENV}\n"
                )
            key, source = read_key(args.admin_key, "--admin-key"), "--admin-key"
        elif os.environ.get(ADMIN_KEY_ENV):
            key, source = read_key(f"env:{ADMIN_KEY_ENV}", ADMIN_KEY_ENV), f"${ADMIN_KEY_ENV}"
        else:
            return None, "admin routes off (no admin key)"
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if key is None:
        raise UsageError("--admin-key is empty")
    if any(key.get_secret_value() == k.get_secret_value() for k in args.keys):
        raise UsageError("the admin key must differ from every app key (else that app is the admin)")
    return key, f"admin key from {source}"
