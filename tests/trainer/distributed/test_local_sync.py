"""Weight sync on one GPU (trainer/distributed/local_sync.py): tied weights sent once, the CPU fallback, and on a
GPU the worker's weights reaching an in-process TorchEngine by CUDA IPC, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.engine import load_engine
from tests.trainer.samples import actor_config, small_batch
from trainer.distributed.local_sync import LocalIPCSync, engine_target, sent_tensors


def test_tied_weights_are_sent_once(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state = model.state_dict()
    unique = sent_tensors(model)
    assert model.config.tie_word_embeddings  # the tiny model ties lm_head to embed_tokens, as SmolLM2
    assert "model.embed_tokens.weight" in unique and "lm_head.weight" not in unique
    assert set(state) - set(unique) == {"lm_head.weight"}


class _NoRemoteCalls:
    """A worker stand-in: LocalIPCSync.create must decide "no" before asking it anything."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"create() asked the worker for {name!r} with a CPU engine")


@pytest.mark.anyio
async def test_a_cpu_engine_keeps_the_general_path(tiny_model_dir: Path) -> None:
    engine = load_engine(str(tiny_model_dir), device="cpu")
    try:
        assert engine_target(engine) == (torch.device("cpu"), torch.float32)
        assert await LocalIPCSync.create(_NoRemoteCalls(), engine) is None
        assert engine_target(object()) is None  # an engine that says nothing of its weights
    finally:
        await engine.stop()


def _state_of(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in engine.model.state_dict().items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.anyio
async def test_cuda_worker_weights_reach_the_engine_bit_for_bit(
    tiny_model_dir: Path, ray_local: None
) -> None:
    """A real TrainerWorker (Ray actor on the GPU) trains one step; the sync puts exactly its weights,
    cast to the engine's dtype, into a TorchEngine in this process, and the version moves."""
    import ray

    from trainer.distributed.worker import TrainerWorker

    cfg = actor_config(tiny_model_dir)
    worker = ray.remote(num_gpus=1, num_cpus=0)(TrainerWorker).remote(cfg, str(tiny_model_dir), "cuda")
    engine = load_engine(str(tiny_model_dir), device="cuda")  # bf16 on cuda
    try:
        before = _state_of(engine)
        await worker.update.remote(small_batch())  # the worker's weights move away from the engine's
        sync = await LocalIPCSync.create(worker, engine)
        assert sync is not None and sync.dtype == torch.bfloat16
        report = await sync.sync()
        assert report.version == 1 == engine.weights_version and report.ipc_replicas == 1
        trained = await worker.named_weights.remote()
        after = _state_of(engine)
        changed = 0
        for name, value in trained.items():
            assert torch.equal(after[name], value.to(torch.bfloat16)), name
            changed += not torch.equal(after[name], before[name])
        assert changed > 0  # the update moved weights, and the engine holds the moved ones
        assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])  # tied, sent once
        report2 = await sync.sync()  # buckets released and made anew each time
        assert report2.version == 2
        with anyio.fail_after(60):
            from agentloop.engine.base import SamplingParams

            out = await engine.generate(
                [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            )
        assert len(out.token_ids) == 4
    finally:
        await engine.stop()
        ray.kill(worker)
