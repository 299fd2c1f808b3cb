"""Update-step throughput of the trainer's Actor (the real PPO/GRPO code path) and, on a GPU, MFU.

    python benchmarks/trainer_bench.py                                   # SmolLM2-135M on this CPU
    python benchmarks/trainer_bench.py --device cuda --random-config qwen2-0.5b --batch 32 --prompt 256 --response 768

One update = old-logprob recompute (a forward) + a PPO forward/backward + AdamW, as Trainer.fit runs it.
``--same-prompt --group 8``: GRPO's shape, 8 attempts sharing each prompt, which the actor runs once
(``actor.shared_prompt_forward``; ``--no-shared-prompt`` for the A/B). ``--critic``: PPO with a value
model (``algorithm.adv_estimator=gae``): each update also computes the critic's values (a forward) and
trains it (a forward/backward and its AdamW), so its FLOPs count too. ``tokens_per_s`` counts the
tokens learned from, ``computed_tokens_per_s`` those run; MFU counts what ran.
FLOPs per token follow the PaLM count: training 6N + 12·L·d·T, a forward alone 2N + 4·L·d·T, with N the
body's matmul parameters; the LM head (V·d) counts on response positions only, where the actor runs it. MFU = achieved FLOP/s / the card's dense bf16 peak.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentloop.types import Triplet
from benchmarks import result_file
from benchmarks.gpu.random_model import RANDOM_CONFIGS, build_random_model
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.model.actor import Actor

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM)


def body_and_head_params(model: torch.nn.Module) -> tuple[int, int]:
    """Matmul parameters of the transformer body (norms and the embedding lookup excluded) and of the LM head."""
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    total = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    body = total - head if cfg.tie_word_embeddings else total - 2 * head  # the embedding is a lookup
    return body, head


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_BF16.items() if k in name), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8, help="samples per update")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    ap.add_argument("--group", type=int, default=2, help="attempts per task (GRPO group size)")
    ap.add_argument(
        "--same-prompt", action="store_true", help="a group's attempts share their prompt, as in GRPO"
    )
    ap.add_argument("--no-shared-prompt", action="store_true", help="actor.shared_prompt_forward=False (A/B)")
    ap.add_argument("--token-budget", type=int, default=16384, help="ppo_max_token_len_per_gpu")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--no-compile", action="store_true", help="actor.use_torch_compile=False (A/B)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates (compilation, allocator)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N CUDA kernels of one update")
    ap.add_argument("--critic", action="store_true", help="PPO with a critic (adv_estimator=gae)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.random_config:
            path = build_random_model(args.random_config, Path(tmp) / "model")
        else:
            from agentloop.engine.models import resolve_model

            path = resolve_model(args.model)
        config = TrainerConfig.from_dict(
            {
                "data": {
                    "train_batch_size": args.batch // args.group,
                    "max_prompt_length": args.prompt,
                    "max_response_length": args.response,
                },
                "actor_rollout_ref": {
                    "model": {"path": str(path), "enable_gradient_checkpointing": args.grad_ckpt},
                    "rollout": {"n": args.group},
                    "actor": {
                        "ppo_mini_batch_size": args.batch // args.group,
                        "shared_prompt_forward": not args.no_shared_prompt,
                        "ppo_max_token_len_per_gpu": args.token_budget,
                        "optim": {"lr": 1e-6},
                        "use_torch_compile": not args.no_compile,
                    },
                },
                "trainer": {"device": args.device},
                "algorithm": {"adv_estimator": "gae" if args.critic else "grpo"},
                "critic": {"ppo_max_token_len_per_gpu": args.token_budget},
            }
        )
        actor = Actor(config, path, args.device)
        vocab = min(actor.model.config.vocab_size, 49152)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
        triplets = [
            Triplet(
                prompt_ids=prompts[i // args.group if args.same_prompt else i],
                response_ids=torch.randint(0, vocab, (args.response,), generator=g).tolist(),
                reward=float(i % 2),
                metadata={"group_id": i // args.group},
            )
            for i in range(args.batch)
        ]
        batch, _ = build_batch(triplets, max_prompt_length=args.prompt, max_response_length=args.response)
        t_warm = time.perf_counter()
        for _ in range(args.warmup):  # compilation, allocator, kernels
            actor.update(batch)
        if actor.device.type == "cuda":
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - t_warm
        if args.profile and actor.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                actor.update(batch)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile)
            print(table, file=sys.stderr)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            actor.update(batch)
        if actor.device.type == "cuda":
            torch.cuda.synchronize()  # note: CPU-GPU sync point, once, for the timing
        elapsed = time.perf_counter() - t0

    cfg = actor.model.config
    body, head = body_and_head_params(actor.model)
    seq = args.prompt + args.response
    attn = cfg.num_hidden_layers * cfg.hidden_size * seq
    tokens = args.batch * seq * args.steps  # the tokens the update learns from
    # the tokens it runs: each distinct prompt once when a group shares it and the actor runs it once
    prompts_run = args.batch // args.group if args.same_prompt and actor.shared_prompts else args.batch
    computed = (prompts_run * args.prompt + args.batch * args.response) * args.steps
    # train step (6x) + old-logprob forward (2x); the LM head runs on response positions only
    flops_per_token = 8 * body + 16 * attn + 8 * head * args.batch * args.response * args.steps / computed
    if actor.critic is not None:  # the critic's values forward (2x) and its train step (6x); no LM head
        flops_per_token += 8 * body + 16 * attn
    card, peak = peak_flops(actor.device)
    achieved = computed * flops_per_token / elapsed
    result = {
        "model": args.random_config or args.model,
        "params_body": body,
        "params_head": head,
        "device": str(actor.device),
        "dtype": "bf16 autocast, fp32 master weights" if actor.device.type == "cuda" else "fp32",
        "torch_compile": actor.compiled,
        "critic": actor.critic is not None,
        "group": args.group,
        "same_prompt": args.same_prompt,
        "shared_prompt_forward": actor.shared_prompts,
        "warmup_s": round(warmup_s, 1),
        "token_budget": args.token_budget,
        "batch": args.batch,
        "seq_len": seq,
        "steps": args.steps,
        "tokens_per_s": round(tokens / elapsed, 1),
        "computed_tokens_per_s": round(computed / elapsed, 1),
        "achieved_tflops": round(achieved / 1e12, 2),
        "mfu": round(achieved / peak, 4) if peak else None,
    }
    gpu = card if actor.device.type == "cuda" else None
    top = result_file.header(
        "trainer_bench", gpu=gpu, torch=torch.__version__, python=platform.python_version()
    )
    document = result_file.result(top, result)
    print(json.dumps(document, indent=2))
    if args.out is not None:
        result_file.write(args.out, document)


if __name__ == "__main__":
    main()
