"""Generated tokens/s of an agentloop engine against its baseline on the same workload, in one run.

``--backend torch``: TorchEngine (continuous batching) vs Hugging Face ``model.generate`` with left
padding (N chat prompts x M new tokens, sampling, eos ignored so both produce exactly N*M tokens).
``--backend vllm``: agentloop's VLLMEngine vs raw vLLM ``AsyncLLM`` (N random-token prompts x M new
tokens, logprobs on), both warm in one process, timed alternately (see benchmarks/gpu/vllm_bench.py).
``--random-config qwen2-0.5b`` builds a random-weight Qwen2-0.5B-shaped bf16 model locally (no hub)
with the SmolLM2 tokenizer. Prints JSON (and writes it to ``--out``).

    python benchmarks/engine_bench.py [--model smollm2-135m-instruct] [--device cpu] [--prompts 32] [--new-tokens 128]
    python benchmarks/engine_bench.py --device cuda --random-config qwen2-0.5b --prompts 128 --new-tokens 128
    python benchmarks/engine_bench.py --quick            # CPU smoke run: 8 prompts x 16 tokens

Both sides warm up on the full batch (4 tokens) before the timed run; the engine's counters
(ms per decode step, prefill seconds, CUDA graph captures / replays) come with the result.
    python benchmarks/engine_bench.py --backend vllm --random-config qwen2-0.5b --prompts 128 --new-tokens 128

``--torch-vs-vllm``: TorchEngine against raw vLLM ``AsyncLLM`` without and with logprobs, warm in one
process (N random-token prompts of ``--prompt-len`` x M new tokens, temperature 1, eos ignored):
    python benchmarks/engine_bench.py --torch-vs-vllm --random-config qwen2-0.5b --prompts 128 --new-tokens 128

``--via-proxy``: what the proxy costs in generated tokens/s. ONE engine (``--backend torch|vllm``)
serves the same workload two ways in alternating rounds: N ``engine.generate`` calls at once
(direct), and N agents at once, each with its own ``openai.AsyncOpenAI`` client making one chat
completion on its own rollout attempt of a real ``Proxy`` + store. The agents run in
``--agent-procs`` processes of their own (default 4, as runners do; 0: in the proxy's process, where
their client work takes the proxy's GIL). Reports ``proxy_loss = 1 - proxy / direct`` (medians) and
where a proxied call's time goes; ``bench_via_proxy`` says why the two ways are the same work.
    python benchmarks/engine_bench.py --via-proxy --quick              # CPU smoke: 16 agents x 16, 4 procs
    python benchmarks/engine_bench.py --via-proxy --quick --agent-procs 0            # agents in this process
    python benchmarks/engine_bench.py --via-proxy --backend vllm --random-config qwen2-0.5b \
        --prompts 128 --new-tokens 128 --reps 5 [--agent-procs 4] [--gc-freeze]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from agentloop.device import pick_device
from agentloop.engine.base import SamplingParams
from agentloop.engine.models import resolve_model
from agentloop.engine.torch.engine import TorchEngine
from agentloop.event_loop import loop_name

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from random_model import RANDOM_CONFIGS, build_random_model

from benchmarks import result_file

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
    "Give me three tips for better sleep.",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
]


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):  # distinct for n <= 32: the engine's same-prompt prefill sharing must not help
        q = QUESTIONS[i % len(QUESTIONS)] + (" Please answer carefully." * ((i // len(QUESTIONS)) % 4))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def bench_hf(model: Any, tok: Any, batch: list[list[int]], new_tokens: int, sp: SamplingParams) -> float:
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": batch}, return_tensors="pt").to(model.device)
    kw = dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or None)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    assert n == len(batch) * new_tokens, (n, len(batch), new_tokens)
    return n / dt


async def bench_engine(
    engine: TorchEngine, batch: list[list[int]], new_tokens: int, sp: SamplingParams
) -> tuple[float, dict[str, Any]]:
    warm = sp.model_copy(update={"max_tokens": 4})  # warm-up on the full batch, as bench_hf does
    await asyncio.gather(
        *[engine.generate(p, warm.model_copy(update={"seed": -1 - i})) for i, p in enumerate(batch)]
    )
    engine._prefix.clear()  # measure without the warm-up's prefix
    before = engine.stats()
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *[engine.generate(p, sp.model_copy(update={"seed": i})) for i, p in enumerate(batch)]
    )
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(batch) * new_tokens, (n, len(batch), new_tokens)
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    decode_s = (
        after["decode_ms_per_step"] * after["decode_steps"]
        - before["decode_ms_per_step"] * before["decode_steps"]
    )
    stats = {
        "decode_steps": steps,
        "mean_decode_batch": round((after["decode_rows"] - before["decode_rows"]) / max(steps, 1), 1),
        "ms_per_decode_step": round(decode_s / max(steps, 1), 2),
        "prefill_s": round(after["prefill_s"] - before["prefill_s"], 3),
        "prefill_batches": after.get("prefill_batches", 0) - before.get("prefill_batches", 0),
        "wall_s": round(dt, 3),
        "cuda_graphs": after["cuda_graphs"],
        "graph_captures_in_timed_run": after["graph_captures"] - before["graph_captures"],
        "graph_replays_in_timed_run": after["graph_replays"] - before["graph_replays"],
    }
    return n / dt, stats


def machine_extra() -> dict[str, Any]:
    """What the header's ``machine`` adds to the CPU, cores and memory for this benchmark."""
    return {
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


# ---------------------------------------------------------------- --via-proxy

TOKENIZER_VOCAB = 49152  # the SmolLM2 tokenizer that every random model here is saved with


def tokenizer_vocab_config(name: str, model_dir: str | None) -> tuple[str, str | None]:
    """A random config with the tokenizer's vocabulary, and its own folder.

    The proxy answers only ids its tokenizer knows (it rejects ids past ``len(tokenizer) + 1024``
    with a 503), while a random model of Qwen2's vocabulary (151936) samples ids up to 151935 from
    SmolLM2's 49152: through the proxy a random model must have the tokenizer's vocabulary.
    """
    derived = f"{name}-vocab{TOKENIZER_VOCAB}"
    RANDOM_CONFIGS.setdefault(derived, {**RANDOM_CONFIGS[name], "vocab_size": TOKENIZER_VOCAB})
    return derived, None if model_dir is None else f"{model_dir.rstrip('/')}-vocab{TOKENIZER_VOCAB}"


def _agent_messages(tag: str, i: int) -> list[dict[str, str]]:
    """Agent ``i``'s one user message in round ``tag`` (unique per round: no prompt is ever cached)."""
    q = QUESTIONS[i % len(QUESTIONS)] + " Please answer carefully." * (i % 4)
    return [{"role": "user", "content": f"[{tag}-{i}] {q}"}]


AGENT_WORKER = Path(__file__).resolve().parent / "proxy_agents.py"


class AgentProcesses:
    """P agent processes (benchmarks/proxy_agents.py, its docstring has the protocol), driven over
    their stdin / stdout from the proxy's event loop. Each round spreads the agents over them in
    contiguous chunks, waits until every process has built its clients, then sends "go" to all."""

    def __init__(self, procs: list[asyncio.subprocess.Process]) -> None:
        self.procs = procs

    @classmethod
    async def start(cls, p: int) -> AgentProcesses:
        procs = []
        try:
            for _ in range(p):
                procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, str(AGENT_WORKER), stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE, limit=1 << 24,
                    )
                )  # fmt: skip
        except BaseException:
            await cls(procs).close()
            raise
        return cls(procs)

    @staticmethod
    async def _send(proc: asyncio.subprocess.Process, obj: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(obj).encode() + b"\n")
        await proc.stdin.drain()

    @staticmethod
    async def _recv(proc: asyncio.subprocess.Process, want: str, timeout_s: float) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not line:
            code = await proc.wait()
            raise RuntimeError(
                f"agent process {proc.pid} exited ({code}) before its {want!r} line (see stderr)"
            )
        msg = json.loads(line)
        if want not in msg:
            raise RuntimeError(
                f"agent process {proc.pid}: expected a {want!r} line, got:\n{msg.get('error', msg)}"
            )
        return msg

    async def round(
        self, agents: list[dict[str, Any]], max_tokens: int, temperature: float, top_p: float
    ) -> tuple[float, float, list[list[Any]]]:
        """(min(start), max(end) over the processes, [[i, tokens, finish, sent, received]] by agent)."""
        n, p = len(agents), len(self.procs)
        chunks = [agents[k * n // p : (k + 1) * n // p] for k in range(p)]
        busy = [(proc, chunk) for proc, chunk in zip(self.procs, chunks, strict=True) if chunk]
        job = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        for proc, chunk in busy:
            await self._send(proc, {**job, "agents": chunk})
        for proc, chunk in busy:  # clients built everywhere before the clock starts
            ready = (await self._recv(proc, "ready", 120))["ready"]
            assert ready == len(chunk), f"agent process {proc.pid} built {ready} of {len(chunk)} clients"
        for proc, _ in busy:  # "go" to all: written back to back, drained after
            assert proc.stdin is not None
            proc.stdin.write(b'{"cmd": "go"}\n')
        for proc, _ in busy:
            assert proc.stdin is not None
            await proc.stdin.drain()
        replies = [await self._recv(proc, "results", 900) for proc, _ in busy]
        rows = sorted((x for r in replies for x in r["results"]), key=lambda x: x[0])
        return min(r["start"] for r in replies), max(r["end"] for r in replies), rows

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    proc.stdin.write(b'{"cmd": "quit"}\n')
                    proc.stdin.close()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:  # stuck mid-round (the bench failed): end it
                proc.kill()
                await proc.wait()


class _TimedEngine:
    """The engine as the proxy sees it: each generate's (start, end) ``time.time()`` recorded by the
    proxy's routing key ("rollout/attempt"), so per-request latency splits into engine and the rest."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.times: dict[str, tuple[float, float]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt_ids: list[int], sampling: Any = None, request_id: str | None = None
    ) -> Any:
        start = time.time()
        out = await self._engine.generate(prompt_ids, sampling, request_id=request_id)
        self.times[(request_id or "").rpartition("/req-")[0]] = (start, time.time())
        return out


# TorchEngine's cumulative counters and engine-thread seconds (its stats()): where a round's engine time went
_ENGINE_COUNTERS = (
    "prefill_batches", "decode_steps", "decode_rows", "graph_captures", "idle_graph_captures",
    "idle_capture_s", "step_s", "schedule_s", "prefill_s", "decode_s", "update_s",
)  # fmt: skip


def _engine_counters(engine: Any) -> dict[str, float]:
    """The engine's cumulative work counters that it reports (TorchEngine's stats(); {} otherwise)."""
    stats = engine.stats() if hasattr(engine, "stats") else {}
    return {k: float(stats[k]) for k in _ENGINE_COUNTERS if isinstance(stats.get(k), int | float)}


def _own_stats(engine: Any) -> Callable[[], Awaitable[list[dict[str, Any]]]]:
    """``idle_captures_settled``'s reader for one in-process engine."""

    async def read() -> list[dict[str, Any]]:
        return [engine.stats()] if hasattr(engine, "stats") else []

    return read


async def idle_captures_settled(
    read_stats: Callable[[], Awaitable[list[dict[str, Any]]]], quiet_s: float = 2.0, limit_s: float = 60.0
) -> float:
    """Wait until the engines whose stats ``read_stats`` returns have made no idle graph capture for
    ``quiet_s`` (TorchEngine captures the smaller batch buckets after its warm-up; at most ``limit_s``);
    returns the seconds waited. Engines without idle captures (vLLM, CPU) return at once."""
    t0 = time.perf_counter()

    def count(stats: list[dict[str, Any]]) -> int | None:
        found = [
            s["idle_graph_captures"] for s in stats if "idle_graph_captures" in s and s.get("cuda_graphs")
        ]
        return sum(found) if found else None

    last = count(await read_stats())
    if last is None:
        return 0.0
    since = time.perf_counter()
    while time.perf_counter() - since < quiet_s and time.perf_counter() - t0 < limit_s:
        await asyncio.sleep(0.1)
        now = count(await read_stats())
        if now != last:
            last, since = now, time.perf_counter()
    return time.perf_counter() - t0


def _critical_path(start: float, end: float, done: list[list[Any]]) -> dict[str, float]:
    """One proxied round's milestones in ms after its "go" (every clock is the host's time.time()):
    the agents' last send, the first and last call into the engine, the last out of it, the last
    response parsed (the round's end). Rows: [i, tokens, finish, sent, received, (engine in, out)]."""
    ms = {
        "last_send": max(d[3] for d in done),
        "first_engine_in": min(d[5][0] for d in done),
        "last_engine_in": max(d[5][0] for d in done),
        "first_engine_out": min(d[5][1] for d in done),
        "last_engine_out": max(d[5][1] for d in done),
        "last_received": end,
    }
    return {k: (t - start) * 1e3 for k, t in ms.items()}


def _spread_ms(spreads: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(spreads) * 1e3, 1), "max": round(max(spreads) * 1e3, 1)}


def _latency_ms(rows: list[dict[str, float]], spreads: list[float], sends: list[float]) -> dict[str, Any]:
    """Medians (and maxima) over every timed proxied call of where its time went, in ms."""

    def stat(key: str) -> dict[str, float]:
        xs = [r[key] * 1e3 for r in rows]
        return {"median": round(statistics.median(xs), 1), "max": round(max(xs), 1)}

    return {
        "client": stat("client"),  # the agent's call, send to parsed response
        "engine_generate": stat("engine"),  # inside engine.generate (queueing in the batch included)
        "added": stat("added"),  # client - engine_generate: HTTP, JSON, proxy logic, store, GIL waits
        "send_to_engine": stat("to_engine"),  # agent sends -> the proxy calls engine.generate
        "engine_to_received": stat("from_engine"),  # engine returns -> the agent has parsed the response
        "proxy_handler_minus_engine": stat("handler"),  # the LLMCall's latency_s - engine_generate
        "engine_admission_spread": _spread_ms(spreads),  # per round: first to last request into the engine
        # per round: the agents' first to last send (their processes build the requests one after another):
        # an admission spread no proxy can beat
        "client_send_spread": _spread_ms(sends),
    }


async def bench_via_proxy(path: Path, args: Any) -> dict[str, Any]:
    """Direct ``engine.generate`` vs N agents through the proxy, on one engine, alternating rounds.

    Same work both ways: the direct prompts are the proxy's own chat-template rendering of each
    agent's messages, and the direct calls replay the SamplingParams the proxy recorded for its calls
    (the template's stop ids, logprobs on); every timed proxy call's recorded prompt ids and sampling
    are checked against the direct ones. The proxy has no way to ask for ``ignore_eos``, so neither
    way sets it: tokens/s counts the tokens each round really produced (finish reasons are reported;
    a random-weight model almost never samples a stop id). Chat completions rather than raw-token
    ``/completions``: that is what agents send, so the templating and token ledger are in the loss.

    ``args.agent_procs`` P > 0: the agents run in P processes of their own (proxy_agents.py), as
    real agents run in runner processes, so their HTTP / JSON / pydantic work does not take the
    proxy's GIL; the round's time is max(end) - min(start) of the processes' own clocks, from "go"
    to the last parsed response. P = 0: the agents run in this process (as the trainer's local
    runner does), timed around their gather. Either way every client is built before the clock
    starts, and each round's rollouts are enqueued and dequeued before it and finished after it.
    """
    import ssl
    import statistics
    import tempfile
    from collections import Counter

    import openai

    from agentloop.proxy import Proxy
    from agentloop.store.memory import MemoryStore
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import AttemptStatus, LLMCall

    n, m = args.prompts, args.new_tokens
    n_procs = min(args.agent_procs, n)
    if n_procs < 0:
        raise SystemExit(f"--agent-procs must be >= 0 (0: agents in this process), got {args.agent_procs}")
    if args.proxy_workers < 0 or (args.proxy_workers and args.store != "sqlite"):
        raise SystemExit(
            f"--proxy-workers must be >= 0 and needs --store sqlite, got {args.proxy_workers}, {args.store}"
        )
    if args.backend == "vllm":
        from agentloop.engine.factory import load_engine

        device, dtype_name = "cuda", "bfloat16"
        engine: Any = load_engine(str(path), device="cuda", backend="vllm", dtype="bfloat16",
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  max_batch_size=max(n, 256))  # fmt: skip
    else:
        device = pick_device(args.device)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        dtype_name = str(dtype).removeprefix("torch.")
        engine = TorchEngine(path, device=device, dtype=dtype, max_batch_size=max(n, 1),
                             cuda_graphs=not args.no_cuda_graphs,
                             idle_graph_capture=not args.no_idle_capture)  # fmt: skip
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    if vocab > len(engine.tokenizer) + 1024:
        raise SystemExit(
            f"--via-proxy: the model's vocabulary ({vocab}) is larger than its tokenizer's "
            f"({len(engine.tokenizer)}); the proxy would reject the ids past it. Use a model whose "
            "vocabulary matches its tokenizer (--random-config does that by itself)."
        )
    t0 = time.perf_counter()
    await engine.start()  # vLLM starts in tens of seconds: not inside the first proxied request
    start_s = time.perf_counter() - t0
    tmp = tempfile.TemporaryDirectory(prefix="engine-bench-proxy-")
    store: Any = SQLiteStore(Path(tmp.name) / "store.db") if args.store == "sqlite" else MemoryStore()
    timed = _TimedEngine(engine)
    proxy = Proxy(timed, store, default_max_tokens=m, workers=args.proxy_workers)
    await proxy.start()
    template = proxy.service.template
    tls = ssl.create_default_context()  # one for all clients (building one per client costs ~20 ms)
    agent_procs: AgentProcesses | None = None
    gen2_ms: dict[str, list[float]] = {"direct": [], "proxy": []}  # each full collection in a timed round
    gc_way: list[str | None] = [None]
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:  # runs in whichever thread triggered it
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        elif gc_way[0] is not None and info["generation"] == 2:
            gen2_ms[gc_way[0]].append((time.perf_counter() - gc_t0[0]) * 1e3)

    @contextlib.contextmanager
    def gc_watch(way: str, tag: str) -> Iterator[None]:
        gc_way[0] = None if tag == "warm" else way
        try:
            yield
        finally:
            gc_way[0] = None

    def render(tag: str, i: int) -> list[int]:
        return template.encode(template.render(_agent_messages(tag, i), None, add_generation_prompt=True))

    async def direct_round(tag: str, sp: SamplingParams) -> tuple[float, list[int], list[str]]:
        batch = [render(tag, i) for i in range(n)]
        with gc_watch("direct", tag):
            t = time.perf_counter()
            outs = await asyncio.gather(*[engine.generate(p, sp) for p in batch])
            dt = time.perf_counter() - t
        return dt, [len(o.token_ids) for o in outs], [o.finish_reason for o in outs]

    async def agents_here(urls: list[str], tag: str, max_tokens: int) -> tuple[float, float, list[list[Any]]]:
        clients = [
            openai.AsyncOpenAI(
                base_url=url, api_key="EMPTY", max_retries=0,
                http_client=openai.DefaultAsyncHttpxClient(verify=tls, timeout=600.0),
            )
            for url in urls
        ]  # fmt: skip

        async def agent(i: int) -> list[Any]:
            sent = time.time()
            r = await clients[i].chat.completions.create(
                model="agentloop", messages=_agent_messages(tag, i),  # type: ignore[arg-type]
                max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
            )  # fmt: skip
            received = time.time()
            assert r.usage is not None
            return [i, r.usage.completion_tokens, str(r.choices[0].finish_reason), sent, received]

        try:
            start = time.time()
            done = await asyncio.gather(*[agent(i) for i in range(n)])
            return start, time.time(), done
        finally:
            for c in clients:
                await c.close()

    async def proxy_round(tag: str, max_tokens: int) -> tuple[float, float, list[list[Any]], list[LLMCall]]:
        for i in range(n):
            await store.enqueue_rollout({"agent": i, "round": tag})
        attempts = [await store.dequeue_rollout(f"bench-agent-{i}") for i in range(n)]
        assert all(a is not None for a in attempts), f"dequeued {sum(a is not None for a in attempts)} of {n}"
        resource = proxy.as_resource()
        urls = [resource.get_base_url(a.rollout_id, a.attempt.attempt_id) for a in attempts if a is not None]
        jobs = [{"i": i, "base_url": u, "messages": _agent_messages(tag, i)} for i, u in enumerate(urls)]
        with gc_watch("proxy", tag):
            if agent_procs is not None:
                start, end, done = await agent_procs.round(jobs, max_tokens, args.temperature, args.top_p)
            else:
                start, end, done = await agents_here(urls, tag, max_tokens)
        assert [d[0] for d in done] == list(range(n)), "an agent's answer is missing"
        calls = []
        for row, a in zip(done, attempts, strict=True):
            assert a is not None
            await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
            (span,) = await store.query_spans(a.rollout_id, a.attempt.attempt_id)
            calls.append(span.payload)
            row.append(timed.times.pop(f"{a.rollout_id}/{a.attempt.attempt_id}"))  # (engine start, end)
        return start, end, done, calls

    direct_tps: list[float] = []
    proxy_tps: list[float] = []
    tokens: dict[str, list[int]] = {"direct": [], "proxy": []}
    reasons: dict[str, Counter[str]] = {"direct": Counter(), "proxy": Counter()}
    weights_versions: set[int | None] = set()
    latency_rows: list[dict[str, float]] = []
    spreads: list[float] = []
    sends: list[float] = []
    engine_work: dict[str, dict[str, float]] = {"direct": {}, "proxy": {}}
    paths: list[dict[str, float]] = []
    gc.callbacks.append(on_gc)
    try:
        if n_procs > 0:
            agent_procs = await AgentProcesses.start(n_procs)
        if args.gc_freeze:  # the startup heap (model, tokenizer, imports) leaves the full collections
            gc.collect()
            gc.freeze()
        # warm-up both ways (short); the proxy's recorded sampling becomes the direct calls' sampling
        _, _, _, calls = await proxy_round("warm", min(m, 8))
        sp = SamplingParams.model_validate(calls[0].sampling).model_copy(update={"max_tokens": m})
        await direct_round("warm", sp.model_copy(update={"max_tokens": min(m, 8)}))
        settled_s = await idle_captures_settled(_own_stats(engine))  # none of them inside a timed round
        for r in range(args.reps):  # ABBA order: a drift over the run hits both ways alike
            for way in ("direct", "proxy") if r % 2 == 0 else ("proxy", "direct"):
                tag = f"{way}{r}"
                counters_before = _engine_counters(engine)
                if way == "direct":
                    dt, counts, fin = await direct_round(tag, sp)
                else:
                    start, end, done, calls = await proxy_round(tag, m)
                    dt = end - start
                    paths.append(_critical_path(start, end, done))
                    counts, fin = [d[1] for d in done], [d[2] for d in done]
                    for i, call in enumerate(calls):  # the same work as the direct round, call by call
                        assert call.prompt_ids == render(tag, i), f"agent {i}: the proxy's prompt differs"
                        assert call.sampling == sp.model_dump(mode="json"), (call.sampling, sp)
                        assert len(call.response_ids) == counts[i], (len(call.response_ids), counts[i])
                        assert call.finish_reason == fin[i], (call.finish_reason, fin[i])
                        weights_versions.add(call.weights_version)
                    for (_, _, _, sent, received, (g0, g1)), call in zip(done, calls, strict=True):
                        client, engine_s = received - sent, g1 - g0
                        latency_rows.append({
                            "client": client, "engine": engine_s, "added": client - engine_s,
                            "to_engine": g0 - sent, "from_engine": received - g1,
                            "handler": (call.latency_s or 0.0) - engine_s,
                        })  # fmt: skip
                    spreads.append(max(d[5][0] for d in done) - min(d[5][0] for d in done))
                    sends.append(max(d[3] for d in done) - min(d[3] for d in done))
                (direct_tps if way == "direct" else proxy_tps).append(sum(counts) / dt)
                for key, value in _engine_counters(engine).items():  # summed over the timed rounds
                    engine_work[way][key] = engine_work[way].get(key, 0.0) + value - counters_before[key]
                tokens[way].append(sum(counts))
                reasons[way].update(fin)
    finally:
        gc.callbacks.remove(on_gc)
        if args.gc_freeze:
            gc.unfreeze()
        if agent_procs is not None:
            await agent_procs.close()
        await proxy.stop()
        await engine.stop()
        await store.close()
        tmp.cleanup()
    direct_med, proxy_med = statistics.median(direct_tps), statistics.median(proxy_tps)
    lengths = [len(render("x", i)) for i in range(n)]
    agents_in = f"{n_procs} processes" if n_procs else "the proxy's process"
    result: dict[str, Any] = {
        "mode": "via_proxy",
        "backend": args.backend,
        "model": args.model,
        "device": device,
        "dtype": dtype_name,
        "workload": {
            "agents": n,
            "max_new_tokens": m,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "logprobs": True,
            "ignore_eos": False,
            "stop_token_ids": sp.stop_token_ids,
            "prompt_tokens_min_max": [min(lengths), max(lengths)],
            "rounds": args.reps,
            "store": args.store,
            "request": "one chat completion per agent, each on its own rollout attempt",
            "clients": "one openai.AsyncOpenAI per agent, built before the clock",
        },
        "agents_in": agents_in,
        "proxy_workers": args.proxy_workers,  # 0: the proxy's work in the engine's process
        "proxy_round_time": (
            "max(end) - min(start) of the agent processes' time.time(), 'go' read to last response parsed"
            if n_procs
            else "time.time() around the agents' gather in this process"
        ),
        "fairness": (
            "token-identical prompts (the proxy's chat-template rendering, checked against every recorded "
            "call) and identical SamplingParams (the proxy's recorded ones, replayed) both ways; the proxy "
            "cannot set ignore_eos, so neither way does and tokens/s counts the tokens really produced"
        ),
        "direct_tokens_per_s": round(direct_med, 1),
        "proxy_tokens_per_s": round(proxy_med, 1),
        "proxy_loss": round(1 - proxy_med / direct_med, 4),
        "rounds_direct": [round(x, 1) for x in direct_tps],
        "rounds_proxy": [round(x, 1) for x in proxy_tps],
        "tokens_per_round": tokens,
        "finish_reasons": {k: dict(v) for k, v in reasons.items()},
        "proxied_call_latency_ms": _latency_ms(latency_rows, spreads, sends),
        "proxied_round_critical_path_ms": {  # medians over the timed proxied rounds, from the round's go
            k: round(statistics.median(p[k] for p in paths), 1) for k in paths[0]
        },
        "direct_round_ms_median": round(
            statistics.median(t / x for t, x in zip(tokens["direct"], direct_tps, strict=True)) * 1e3, 1
        ),
        "idle_graph_capture": bool(engine.stats().get("cuda_graphs")) and not args.no_idle_capture
        if args.backend == "torch"
        else False,
        "idle_captures_settled_s": round(settled_s, 2),  # waited after the warm-up for the idle captures
        "weights_versions_recorded": sorted(v for v in weights_versions if v is not None),
        "gc_freeze": args.gc_freeze,
        "event_loop": loop_name(),
        "full_gc_in_timed_rounds": {  # a collection of generation 2 stops every thread of this process
            way: {"count": len(ms), "ms": round(sum(ms), 1)} for way, ms in gen2_ms.items()
        },
        "engine_start_s": round(start_s, 1),
        "engine_work_in_timed_rounds": {  # TorchEngine: more prefill batches through the proxy = arrivals spread
            way: {k: round(v, 3) for k, v in work.items()} for way, work in engine_work.items()
        },
    }
    if args.backend == "vllm":
        result["vllm"] = __import__("vllm").__version__
    return result


def emit(figures: dict[str, Any], out: str | None, **machine: Any) -> None:
    """Print the run's result (the header, then ``figures``) and write it to ``out``; ``machine``: added
    to the header's machine. The card is the GPU this process used, none for a run on the CPU."""
    gpu = torch.cuda.get_device_name(0) if str(figures.get("device", "cuda")).startswith("cuda") else None
    document = result_file.result(
        result_file.header("engine_bench", gpu=gpu, **machine_extra(), **machine), figures
    )
    print(json.dumps(document, indent=2))
    if out:
        result_file.write(out, document)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None)
    ap.add_argument("--model-dir", default=None, help="where --random-config builds its model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="vllm backend: random prompt length")
    ap.add_argument("--reps", type=int, default=3, help="vllm backend and --via-proxy: timed rounds per way")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 prompts x 16 new tokens")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="TorchEngine without CUDA graphs (A/B)")
    ap.add_argument("--no-idle-capture", action="store_true",
                    help="TorchEngine captures decode graphs only when a step needs one (A/B)")  # fmt: skip
    ap.add_argument("--via-proxy", action="store_true", help="direct engine vs N agents through the proxy")
    ap.add_argument(
        "--torch-vs-vllm", action="store_true", help="TorchEngine vs raw vLLM without and with logprobs (GPU)"
    )
    ap.add_argument("--store", choices=["sqlite", "memory"], default="sqlite", help="--via-proxy: the store")
    ap.add_argument(
        "--agent-procs",
        type=int,
        default=4,
        help="--via-proxy: processes the agents run in, spread evenly (0: in the proxy's process)",
    )
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="--via-proxy: gc.freeze() once all has started, so full collections skip the startup heap",
    )
    ap.add_argument(
        "--proxy-workers",
        type=int,
        default=0,
        help="--via-proxy: Proxy(workers=N), the proxy's per-call work in N processes (needs --store sqlite)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="--via-proxy, vllm backend")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = (16 if args.via_proxy else 8), 16
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.random_config:
        name, model_dir = args.random_config, args.model_dir
        if args.via_proxy:
            name, model_dir = tokenizer_vocab_config(name, model_dir)
        path = build_random_model(name, model_dir)
        args.model = f"random:{name}"
    else:
        path = resolve_model(args.model)
    if args.via_proxy:
        result = await bench_via_proxy(path, args)
        emit(result, args.out)
        return
    if args.torch_vs_vllm:
        from vllm_bench import bench_torch_vs_vllm

        result = await bench_torch_vs_vllm(path, args)
        emit(result, args.out)
        return
    if args.backend == "vllm":
        from vllm_bench import bench_vllm

        result = await bench_vllm(path, args)
        emit(result, args.out)
        return
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    batch = prompts(tok, args.prompts)
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        logprobs=True,
    )
    engine = TorchEngine(
        path,
        device=device,
        dtype=dtype,
        max_batch_size=max(args.prompts, 1),
        cuda_graphs=not args.no_cuda_graphs,
        idle_graph_capture=not args.no_idle_capture,
    )
    load = {"start": round(os.getloadavg()[0], 2)}  # other users of the machine skew CPU figures
    engine_tps, engine_stats = await bench_engine(engine, batch, args.new_tokens, sp)
    load["after_engine"] = round(os.getloadavg()[0], 2)
    await engine.stop()
    del engine
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    hf_tps = bench_hf(hf, tok, batch, args.new_tokens, sp)
    load["after_hf"] = round(os.getloadavg()[0], 2)
    result = {
        "model": args.model,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "workload": {
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "ignore_eos": True,
            "prompt_tokens_min_max": [min(map(len, batch)), max(map(len, batch))],
        },
        "torch_engine_tokens_per_s": round(engine_tps, 1),
        "hf_generate_left_padding_tokens_per_s": round(hf_tps, 1),
        "ratio": round(engine_tps / hf_tps, 2),
        "torch_engine_stats": engine_stats,
    }
    emit(result, args.out, load_avg_1m=load)


if __name__ == "__main__":
    from agentloop.event_loop import run

    run(main)  # uvloop where installed (AGENTLOOP_UVLOOP=0: asyncio's loop), as agentloop serve runs
