"""Weight sync from data-parallel ranks into engine replicas: bucket layout and packing, manifest
checks, the gloo broadcast path end to end (1 FSDP2 rank + 2 replica actors), CUDA IPC on a GPU."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from trainer.distributed.weight_sync import (
    Manifest,
    WeightSync,
    fetch_engine_weights,
    manifest_of,
    open_ipc,
    pack,
    plan_layout,
    send_specs,
    unpack,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_plan_layout_buckets_by_dtype_size_and_alignment() -> None:
    specs = {
        "a": ((3, 5), torch.float32),  # 60 bytes
        "b": ((7,), torch.bfloat16),
        "c": ((100,), torch.float32),  # 400 bytes: starts at 64 elements (256-byte aligned)
        "d": ((300,), torch.float32),  # 1200 bytes > bucket_bytes: a bucket of its own
        "e": ((2,), torch.float32),
    }
    layout = plan_layout(specs, bucket_bytes=1024)
    f32 = [b for b in layout.buckets if b.dtype == torch.float32]
    assert [[e.name for e in b.entries] for b in f32] == [["a", "c"], ["d"], ["e"]]
    assert [e.offset for e in f32[0].entries] == [0, 64]
    assert f32[0].numel == 164
    assert [e.name for b in layout.buckets if b.dtype == torch.bfloat16 for e in b.entries] == ["b"]
    assert sorted(layout.names) == sorted(specs)
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 256"):
        plan_layout(specs, bucket_bytes=0)
    with pytest.raises(ValueError, match="at least one tensor spec"):
        plan_layout({})


def test_pack_and_unpack_round_trip_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    named = {
        "w": torch.randn(4, 6, generator=g),
        "b": torch.randn(6, generator=g).to(torch.bfloat16),
        "big": torch.randn(33, 9, generator=g),
    }
    layout = plan_layout({k: (tuple(v.shape), v.dtype) for k, v in named.items()}, bucket_bytes=512)
    assert len(layout.buckets) == 3
    buckets = pack(named, layout)
    back = unpack(buckets, layout)
    for k, v in named.items():
        assert torch.equal(back[k], v), k
    back["w"].zero_()  # views, not copies: writing one writes the bucket
    assert float(buckets[0][:24].abs().sum()) == 0.0
    # casting happens on packing: fp32 trainer tensors into a bf16 engine layout
    half = plan_layout({"w": ((4, 6), torch.bfloat16)})
    assert torch.equal(unpack(pack({"w": named["w"]}, half), half)["w"], named["w"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="missing"):
        pack({"w": named["w"]}, layout)
    with pytest.raises(ValueError, match="expected a bucket of"):
        unpack([b.float() if b.dtype == torch.bfloat16 else b for b in buckets], layout)


def test_manifest_checks_name_the_tensors_that_differ(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    manifest = manifest_of(model)
    trainer = {k: shape for k, (shape, _) in manifest.specs.items()}
    tied = bool(manifest.aliases)
    sent = send_specs(trainer, manifest)
    assert set(sent) == set(trainer) - set(manifest.aliases)
    assert ("lm_head.weight" not in sent) == tied  # a tied head is sent once, as the embedding
    bad = dict(trainer)
    name = next(iter(bad))
    bad[name] = (1, 2)
    with pytest.raises(ValueError, match=rf"shape mismatches \[.{name}: trainer \(1, 2\)"):
        send_specs(bad, manifest)
    missing = {k: v for k, v in trainer.items() if k != name}
    with pytest.raises(ValueError, match=rf"engine-only tensors \['{name}'\]"):
        send_specs(missing, manifest)
    with pytest.raises(ValueError, match=r"trainer-only tensors \['extra.weight'\]"):
        send_specs({**trainer, "extra.weight": (2,)}, manifest)
    untied = Manifest(dict(manifest.specs), {})  # an engine that does not tie: both names are sent
    assert set(send_specs(trainer, untied)) == set(trainer)


def _config(model_dir: Path, fsdp_size: int = -1) -> object:
    from trainer.config import TrainerConfig

    return TrainerConfig.from_dict(
        {
            "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": 16},
            "actor_rollout_ref": {
                "model": {"path": str(model_dir)},
                "rollout": {"n": 2},
                "actor": {
                    "ppo_mini_batch_size": 2,
                    "optim": {"lr": 0.05, "weight_decay": 0.0},
                    "fsdp_config": {"fsdp_size": fsdp_size},
                },
            },
            "trainer": {"device": "cpu"},
        }
    )


def _batch() -> object:
    from agentloop.types import Triplet
    from trainer.batch import build_batch

    triplets = [
        Triplet(
            prompt_ids=[5 + i, 17, 99 + i],
            response_ids=[40 + i, 41, 42],
            reward=float(i % 2),
            metadata={"group_id": i // 2},
        )
        for i in range(4)
    ]
    return build_batch(triplets, max_prompt_length=32, max_response_length=16)[0]


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.parametrize(("ranks", "fsdp_size"), [(1, -1), (2, 1)])  # also replicated on 2 ranks (HSDP mesh)
async def test_broadcast_path_moves_the_exact_weights_into_every_replica(
    tiny_model_dir: Path, ray_local: None, ranks: int, fsdp_size: int
) -> None:
    import ray

    from agentloop.engine.replicas import EngineReplicaPool
    from trainer.distributed.data_parallel import DataParallelGroup

    pool = EngineReplicaPool.create(str(tiny_model_dir), 2, "cpu", max_context=128, max_batch_size=4)
    cfg = _config(tiny_model_dir, fsdp_size)
    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", ranks)  # type: ignore[arg-type]
    sync = WeightSync(group, pool, bucket_bytes=1 << 20)  # ~1 MiB buckets: several per sync
    prompt = [1, 2, 3, 4, 5]
    try:
        with anyio.fail_after(120):
            before = [
                (await pool.generate(prompt, GREEDY, request_id=f"k{i}/r0")).token_ids for i in range(2)
            ]
            await group.update.remote(_batch())  # a large step: the policy moves
            report = await sync.sync()
            assert report.broadcast_replicas == 2 and report.ipc_replicas == 0
            assert report.version == 1 and pool.weights_version == 1
            assert pool.stats()["syncs"] == 1 and pool.stats()["last_sync_s"] == report.seconds
            assert len(sync.layout.buckets) > 1  # type: ignore[union-attr]
            trained = await group.named_weights.remote()
            for j in range(2):
                got = await fetch_engine_weights(pool, j)
                assert got.keys() == trained.keys()
                for k in trained:
                    assert torch.equal(got[k], trained[k]), f"replica {j}: {k}"
            after = [(await pool.generate(prompt, GREEDY, request_id=f"k{i}/r1")).token_ids for i in range(2)]
            assert after[0] == after[1]
            assert after != before, "the update should change the greedy output of the tiny model"
            assert (await sync.sync()).version == 2  # the group is reused
    finally:
        await sync.close()
        group.shutdown()
        await pool.stop()
        for r in pool.replicas:
            ray.kill(r)


def test_weight_sync_validates_its_arguments() -> None:
    with pytest.raises(TypeError, match=r"needs a trainer\.distributed\.data_parallel\.DataParallelGroup"):
        WeightSync(object(), object())


def _ipc_child(handles: list, queue: object) -> None:  # runs in a spawned process
    torch.cuda.set_device(0)
    (flat,) = open_ipc(handles, 0)
    queue.put(float(flat.float().sum()))  # type: ignore[attr-defined]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a GPU; CPU runs test the packing only"
)
@pytest.mark.e2e
def test_ipc_handles_open_in_another_process() -> None:
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    named = {"a": torch.arange(10, dtype=torch.float32, device="cuda"), "b": torch.ones(3, device="cuda")}
    layout = plan_layout({k: (tuple(v.shape), torch.bfloat16) for k, v in named.items()})
    buckets = pack(named, layout, "cuda")
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_ipc_child, args=([reduce_tensor(buckets[0])[1]], queue))
    proc.start()
    assert queue.get(timeout=120) == pytest.approx(48.0)
    proc.join(60)
    assert proc.exitcode == 0
