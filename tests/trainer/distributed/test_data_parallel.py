"""Data-parallel training: 2 gloo ranks (Ray actors, FSDP2) take the same step as one Actor."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agentloop.types import Triplet
from tests.trainer.tolerances import EPS32, assert_one_adam_step_agrees, gradient_noise
from trainer.batch import build_batch
from trainer.config import FSDPConfig, TrainerConfig
from trainer.distributed.data_parallel import DataParallelGroup, balance_by_tokens
from trainer.model.actor import Actor


def _config(
    model_dir: Path,
    token_budget: int,
    estimator: str = "grpo",
    reshard_after_forward: bool = True,
    grad_sync_per_micro_batch: bool = True,
    fsdp_size: int = -1,
    mixed_precision: dict[str, str] | None = None,
    layers_per_unit: int = 1,
    skip_fsdp_when_replicated: bool = False,
) -> TrainerConfig:
    return TrainerConfig.from_dict(
        {
            "algorithm": {"adv_estimator": estimator},
            "critic": {"optim": {"lr": 1e-3, "weight_decay": 0.0}, "ppo_max_token_len_per_gpu": token_budget},
            "data": {"train_batch_size": 3, "max_prompt_length": 32, "max_response_length": 16},
            "actor_rollout_ref": {
                "model": {"path": str(model_dir)},
                "rollout": {"n": 2},
                "actor": {
                    "ppo_mini_batch_size": 3,
                    "ppo_max_token_len_per_gpu": token_budget,
                    "optim": {"lr": 1e-3, "weight_decay": 0.0},
                    "grad_clip": 1.0,
                    "entropy_coeff": 0.01,
                    "fsdp_config": {
                        "reshard_after_forward": reshard_after_forward,
                        "grad_sync_per_micro_batch": grad_sync_per_micro_batch,
                        "fsdp_size": fsdp_size,
                        "mixed_precision": mixed_precision or {},
                        "layers_per_unit": layers_per_unit,
                        "skip_fsdp_when_replicated": skip_fsdp_when_replicated,
                    },
                },
            },
            "trainer": {"device": "cpu"},
        }
    )


def _triplets() -> list[Triplet]:
    rng, engine_rng = random.Random(0), random.Random(1)
    out = []
    for i in range(6):  # lengths differ, so ranks get different row counts and micro-batch counts
        prompt = [rng.randrange(3, 49152) for _ in range(2 + 3 * i)]
        response = [rng.randrange(3, 49152) for _ in range(1 + (i * 5) % 9)]
        out.append(
            Triplet(
                prompt_ids=prompt,
                response_ids=response,
                reward=float(i % 3 == 0),
                metadata={"group_id": i // 2},
                # the engine's log-probs: on-policy, the update reports its gap to them (max over ranks);
                # from a stream of their own, so the batch's tokens stay what the tolerances were set on
                response_logprobs=[-5 * engine_rng.random() for _ in response],
            )
        )
    return out


def test_balance_by_tokens_is_greedy_and_deterministic() -> None:
    parts = balance_by_tokens([10, 1, 9, 2, 8, 3], 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    totals = [sum([10, 1, 9, 2, 8, 3][i] for i in p) for p in parts]
    assert abs(totals[0] - totals[1]) <= 1, totals
    assert parts == balance_by_tokens([10, 1, 9, 2, 8, 3], 2)
    assert balance_by_tokens([5], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balance_by_tokens([1], 0)


def test_fsdp_size_picks_the_mesh_or_says_what_divides() -> None:
    from trainer.distributed.data_parallel import data_parallel_mesh

    assert data_parallel_mesh("cpu", 4, -1) is None  # FSDP2's default mesh: sharded over all ranks
    assert data_parallel_mesh("cpu", 4, 4) is None
    assert data_parallel_mesh("cpu", 4, 8) is None  # verl reads fsdp_size >= the ranks as all of them
    assert data_parallel_mesh("cpu", 1, 2) is None  # so a one-rank group takes any fsdp_size
    with pytest.raises(ValueError, match=r"fsdp_size=3 must divide the trainer's 4 ranks \(or be -1"):
        data_parallel_mesh("cpu", 4, 3)


def _collective_counters() -> tuple[Callable[[Any], None], Callable[[Any], dict[str, Any]]]:
    """Two functions to run in each rank (DPWorker.call): the first starts counting FSDP2's parameter
    all-gathers and gradient reduce-scatters on the wire, every all-reduce, and the policy's forwards
    with autograd on (one per training micro-batch; the log-prob passes run without); the second
    returns the counts, the dtypes each kind of collective carried, the dimensions of the mesh and
    the number of FSDP units. Nested, so Ray pickles them by value (the ranks cannot import this test
    module)."""

    def start(worker: Any) -> None:
        import torch.distributed as dist

        counts = worker.extensions["counts"] = {
            "all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "train_forward": 0
        }  # fmt: skip
        dtypes = worker.extensions["dtypes"] = {
            "all_gather": set(),
            "reduce_scatter": set(),
            "all_reduce": set(),
        }

        def count(key: str, new: str, old: str) -> None:
            # the calls FSDP2 makes: *_single in torch 2.13, *_tensor before they existed
            name = new if hasattr(dist, new) else old
            collective = getattr(dist, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                counts[key] += 1
                tensor = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
                dtypes[key].add(str(tensor.dtype))  # the output buffer: the dtype on the wire
                return collective(*args, **kwargs)

            setattr(dist, name, counted)  # in this rank's process only, which ends with the test

        count("all_gather", "all_gather_single", "all_gather_into_tensor")
        count("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")
        count("all_reduce", "all_reduce", "all_reduce")  # HSDP's and fsdp_size=1's gradients, metrics too

        def forward_hook(*_: Any) -> None:
            counts["train_forward"] += torch.is_grad_enabled()

        # the decoder runs in both of the policy's forwards: the model's own and its head forward
        worker.actor.model.get_decoder().register_forward_hook(forward_hook)
        model, name = (
            worker.actor.model,
            "agentloop_response_logprobs",
        )  # trainer.distributed._sharding.HEAD_FORWARD
        counts["head_forward"] = 0
        if hasattr(model, name):
            head_forward = getattr(model, name)

            def counted_head_forward(*args: Any) -> Any:
                out = head_forward(*args)
                counts["head_forward"] += out is not None  # None: it fell back to the full logits
                return out

            setattr(model, name, counted_head_forward)

    def read(worker: Any) -> dict[str, Any]:
        from torch.distributed.fsdp import FSDPModule

        # FSDP units: one state per fully_shard call (a group of layers is one unit, several modules)
        units = len(
            {id(m._get_fsdp_state()) for m in worker.actor.model.modules() if isinstance(m, FSDPModule)}
        )
        first = next(worker.actor.model.parameters())  # 2: (replicate, shard); 0: a plain tensor, no FSDP
        mesh_dims = int(first.device_mesh.ndim) if hasattr(first, "device_mesh") else 0
        dtypes = {f"{k}_dtypes": sorted(v) for k, v in worker.extensions["dtypes"].items()}
        return {**worker.extensions["counts"], **dtypes, "units": units, "mesh_dims": mesh_dims}

    return start, read


def _counted_step(
    cfg: TrainerConfig, model_dir: Path, batch: Any, world: int
) -> tuple[dict[str, float], dict[str, torch.Tensor], list[dict[str, Any]]]:
    """One update of ``batch`` by ``world`` gloo ranks with ``_collective_counters`` on: the metrics, the
    weights after it and each rank's counts."""
    import anyio
    import ray

    group = DataParallelGroup.create(cfg, str(model_dir), "cpu", world_size=world)
    try:
        start_counting, read_counts = _collective_counters()
        ray.get([w.call.remote(start_counting) for w in group.workers])

        async def step() -> tuple[dict[str, float], dict[str, torch.Tensor]]:
            metrics = await group.update.remote(batch)
            return metrics, await group.named_weights.remote()

        metrics, weights = anyio.run(step)
        return metrics, weights, ray.get([w.call.remote(read_counts) for w in group.workers])
    finally:
        group.shutdown()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("reshard_after_forward", "grad_sync_per_micro_batch", "fsdp_size", "world", "layers_per_unit"),
    [
        (True, True, -1, 2, 1),
        (False, False, 1, 2, 1),
        (True, True, -1, 2, 2),  # both decoder layers in one unit: one all-gather and reduce-scatter for them
        # whole copies without FSDP2 (fsdp_config.skip_fsdp_when_replicated): 0 units a layer
        (True, True, 1, 2, 0),
        # the rest are .ci/run's slow tests (make test holds both options flipped, replicated): both
        # flipped with full sharding, then one at a time
        pytest.param(False, False, -1, 2, 1, marks=pytest.mark.slow),
        pytest.param(True, False, -1, 2, 1, marks=pytest.mark.slow),
        pytest.param(False, True, -1, 2, 1, marks=pytest.mark.slow),
        # HSDP: sharded within 2 groups of 2 ranks, reduce-scatter then all-reduce
        pytest.param(True, True, 2, 4, 1, marks=pytest.mark.slow),
    ],
)
def test_two_ranks_take_the_same_step_as_one(
    tiny_model_dir: Path,
    ray_local: None,
    reshard_after_forward: bool,
    grad_sync_per_micro_batch: bool,
    fsdp_size: int,
    world: int,
    layers_per_unit: int,
) -> None:
    """Also with parameters kept gathered from forward to backward (fewer all-gathers), with gradients
    reduce-scattered once per mini-batch instead of once per micro-batch, replicated on each rank
    (fsdp_size=1: no all-gather, no reduce-scatter, gradients all-reduced), on 4 ranks in 2 shard
    groups of 2 (HSDP), and with the decoder layers grouped into FSDP units of two; the counts are
    checked: the same step. ``layers_per_unit`` 0 stands for whole copies trained without FSDP2
    (``skip_fsdp_when_replicated``): no FSDP unit, and the gradients summed in one all-reduce a step."""
    # several micro-batches per rank, uneven counts: 2 and 3 (5 on one rank), so one rank's last micro-batch,
    # the one that reduce-scatters with grad_sync_per_micro_batch=False, is a padding one
    without_fsdp = layers_per_unit == 0
    cfg = _config(
        tiny_model_dir,
        token_budget=32,
        reshard_after_forward=reshard_after_forward,
        grad_sync_per_micro_batch=grad_sync_per_micro_batch,
        fsdp_size=fsdp_size,
        layers_per_unit=max(layers_per_unit, 1),
        skip_fsdp_when_replicated=without_fsdp,
    )
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    single = Actor(cfg, tiny_model_dir, "cpu")
    before = single.named_weights()
    m1 = single.update(batch)
    expected = single.named_weights()
    m2, got, counts = _counted_step(cfg, tiny_model_dir, batch, world)
    # every rank issues the same collectives (padded micro-batch counts), or the group would hang
    assert all(c == counts[0] for c in counts), counts
    steps, micro, units = int(m2["actor/optimizer_steps"]), counts[0]["train_forward"], counts[0]["units"]
    layers = 2  # the tiny model's decoder layers, in units of layers_per_unit, and the root unit
    assert units == (0 if without_fsdp else -(-layers // layers_per_unit) + 1), counts[0]
    assert micro > steps, f"the batch must give several micro-batches per mini-batch: {micro} for {steps}"
    if without_fsdp:  # the single actor's own forward, which runs the LM head chunked itself
        assert counts[0]["mesh_dims"] == counts[0]["all_gather"] == counts[0]["reduce_scatter"] == 0, counts
        # all-reduces a step: the loss metrics (float64), the engine gap's max and the gradients (the tiny
        # model's 11.6 MB of fp32 in one 256 MiB bucket); on-policy, no old log-prob rows to gather
        assert counts[0]["all_reduce"] == 3 * steps, counts[0]
        assert counts[0]["all_reduce_dtypes"] == ["torch.float32", "torch.float64"], counts[0]
    else:
        # the ranks score tokens as the single actor does: the LM head run chunked on the response positions
        assert counts[0]["head_forward"] >= micro, counts[0]
    per = micro if grad_sync_per_micro_batch else steps  # reduce-scatters per FSDP unit
    if without_fsdp:
        per = 0
    elif fsdp_size == 1:  # a shard group of one rank: the parameters are whole, the gradients all-reduced
        per = 0
        assert counts[0]["all_gather"] == 0, counts[0]
    else:
        assert counts[0]["all_gather"] >= units * micro, counts[0]  # one per unit and forward, at least
    if not without_fsdp:
        assert counts[0]["mesh_dims"] == (1 if fsdp_size == -1 else 2), counts[0]
    assert counts[0]["reduce_scatter"] == units * per, (
        f"grad_sync_per_micro_batch={grad_sync_per_micro_batch}: {counts[0]['reduce_scatter']} gradient "
        f"reduce-scatters for {units} FSDP units, {micro} micro-batches and {steps} optimizer steps"
    )
    if counts[0]["reduce_scatter"]:  # fsdp_config.mixed_precision left at fp32: fp32 on the wire
        assert counts[0]["reduce_scatter_dtypes"] == ["torch.float32"], counts[0]
    assert counts[0]["all_gather_dtypes"] in ([], ["torch.float32"]), counts[0]
    assert "torch.bfloat16" not in counts[0]["all_reduce_dtypes"], counts[0]
    assert got.keys() == expected.keys()
    moved = max(float((expected[k] - before[k]).abs().max()) for k in expected)
    assert moved > 5e-4, "the update must move the weights for the comparison to mean something"
    # Tolerances from the computation, not from one CPU. The two runs sum the same fp32 terms in other
    # orders (also where a rank adds up its micro-batches before the ranks are summed, not after), so
    # their clipped gradients differ by up to gradient_noise (clip norm 1; test_actor's micro-batch test
    # has the same bound); assert_one_adam_step_agrees turns that into a bound on each weight.
    eps, lr = EPS32, 1e-3  # the config's lr
    noise = gradient_noise(int(batch.attention_mask.sum()), 49152)
    assert m1["actor/optimizer_steps"] == 1, "the bound below is for one Adam step"
    for k in expected:
        assert_one_adam_step_agrees(
            got[k], expected[k], before[k], lr=lr, noise=noise, what=f"{k}: 2 ranks vs 1"
        )
    # entropy (4.35): per-token error <= eps * M * (M + log2 V) ~ 4e-4 at logit scale M ~ 50 (see test_actor),
    # 1e-4 relative; grad_norm: relative error ~ sqrt(V) * eps = 3e-5; pg_loss ~ 0 (GRPO advantages cancel):
    # a mean of |A| <= 1 over the response tokens, summed in another order: error <= n * eps
    pg_atol = int(batch.response_mask.sum()) * eps
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=pg_atol), key
    # the train/engine gap (log-probs ~ 10 against engine values in [-5, 0]): a few ulps of 10 apart
    assert m1["actor/old_logprobs_from_the_loss"] == m2["actor/old_logprobs_from_the_loss"] == 1.0
    for key in ("actor/engine_logprob_gap_mean", "actor/engine_logprob_gap_max"):
        assert m2[key] == pytest.approx(m1[key], abs=64 * eps * 10), key


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype", "fsdp_size", "grad_sync_per_micro_batch"),
    [
        # replicated, one all-reduce per mini-batch: the unsynced gradients add up in bf16 too
        ("fp32", "bf16", 1, False),
        # whole copies without FSDP2 (fsdp_size 0 here: skip_fsdp_when_replicated with fsdp_size 1)
        ("fp32", "bf16", 0, True),
        pytest.param("fp32", "bf16", -1, True, marks=pytest.mark.slow),  # bf16 reduce-scatters
        pytest.param("bf16", "bf16", -1, True, marks=pytest.mark.slow),
    ],
)
def test_mixed_precision_moves_bf16_and_keeps_the_fp32_step(
    tiny_model_dir: Path,
    ray_local: None,
    param_dtype: str,
    reduce_dtype: str,
    fsdp_size: int,
    grad_sync_per_micro_batch: bool,
) -> None:
    """fsdp_config.mixed_precision: the collectives carry bf16 where asked, the master weights stay fp32,
    and the step is one rank's fp32 step up to bf16 rounding of the gradients (and of the forward)."""
    mixed = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
    cfg = _config(
        tiny_model_dir,
        token_budget=32,
        grad_sync_per_micro_batch=grad_sync_per_micro_batch,
        fsdp_size=fsdp_size or 1,  # 0: skip_fsdp_when_replicated with fsdp_size 1
        mixed_precision=mixed,
        skip_fsdp_when_replicated=fsdp_size == 0,
    )
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    single = Actor(_config(tiny_model_dir, token_budget=32), tiny_model_dir, "cpu")
    before = single.named_weights()
    m1 = single.update(batch)
    expected = single.named_weights()
    m2, got, per_rank = _counted_step(cfg, tiny_model_dir, batch, world=2)
    counts = per_rank[0]
    wire = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}
    if fsdp_size in (0, 1):  # no parameter all-gather, no reduce-scatter: the gradients are all-reduced
        assert counts["all_gather"] == counts["reduce_scatter"] == 0, counts
        assert wire[reduce_dtype] in counts["all_reduce_dtypes"], counts
    else:
        assert counts["reduce_scatter_dtypes"] == [wire[reduce_dtype]], counts
        assert counts["all_gather_dtypes"] == [wire[param_dtype]], counts
    assert all(got[k].dtype == torch.float32 for k in got), "the master weights must stay fp32"
    lr = 1e-3  # the config's; one AdamW step from zero state moves a weight by lr * g / (|g| + eps):
    # +-lr wherever |g| is above the rounding, so bf16 changes a step only where g's sign flips (2 * lr)
    flipped = sum(int(((got[k] - expected[k]).abs() > lr).sum()) for k in expected)
    moved = sum(int(((expected[k] - before[k]).abs() > lr / 2).sum()) for k in expected)
    assert moved > 10**6, "the update must move the weights for the comparison to mean something"
    if param_dtype == "fp32":
        # only the reduction rounds (and, unsynced, the micro-batches' sum): each rank's gradient, the
        # partial sums and the result go to bf16, unit roundoff u = 2^-8, so an element's error is a few
        # u * (|g1| + |g2|). A sign flips only where |g1 + g2| is within that of 0: 23 of 2.9M weights with
        # reduce-scatters here, 1e-3 leaves room for another CPU's float order. The norm sums those
        # errors over 2.9M elements of either sign: 8e-5 relative here; 2u holds it unless the ranks'
        # gradients mostly cancel (a mean instead of a sum halves it)
        assert flipped <= 1e-3 * moved, f"{flipped} of {moved} weights stepped the other way"
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=2**-7)
    else:
        # the forward and backward run in bf16 too. GRPO's advantages cancel (pg_loss ~ 0), so the
        # gradient is a small difference of large terms and its bf16 error is not small relative to it:
        # grad_norm 15.7 vs 19.5 here and 0.9% of the weights step the other way. A wrong reduction
        # (a rank's gradient lost or doubled) flips about half of them
        assert flipped <= 0.05 * moved, f"{flipped} of {moved} weights stepped the other way"
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=0.35)
    # bf16 logits: the mean entropy moved 0.3% on this batch with bf16 parameters and 0.9% on another
    # (bf16's unit roundoff is 0.4%, grown through the layers); wrong weights would move it far more
    assert m2["actor/entropy"] == pytest.approx(m1["actor/entropy"], rel=2**-6)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("grad_sync_per_micro_batch", "fsdp_size"),
    [
        (True, -1),
        (True, 0),  # whole copies without FSDP2 (skip_fsdp_when_replicated with fsdp_size 1)
        pytest.param(False, -1, marks=pytest.mark.slow),
        pytest.param(False, 1, marks=pytest.mark.slow),
    ],
)
def test_two_ranks_train_the_critic_as_one(
    tiny_model_dir: Path, ray_local: None, grad_sync_per_micro_batch: bool, fsdp_size: int
) -> None:
    """PPO with a critic (gae): the sharded critic's values, loss and update equal one device's, also
    with one gradient reduce-scatter per mini-batch and replicated on each rank (the critic shards as
    the actor's fsdp_config says)."""
    cfg = _config(
        tiny_model_dir,
        token_budget=40,
        estimator="gae",
        grad_sync_per_micro_batch=grad_sync_per_micro_batch,
        fsdp_size=fsdp_size or 1,  # 0: skip_fsdp_when_replicated with fsdp_size 1
        skip_fsdp_when_replicated=fsdp_size == 0,
    )
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    single = Actor(cfg, tiny_model_dir, "cpu")
    one = [single.update(batch) for _ in range(2)]
    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        import anyio
        import ray

        async def steps() -> list[dict[str, float]]:
            return [await group.update.remote(batch) for _ in range(2)]

        two = anyio.run(steps)

        def mesh_dims(worker: Any) -> int:  # nested: Ray pickles it by value; 0: a plain tensor
            first = next(worker.actor.critic.model.parameters())
            return int(first.device_mesh.ndim) if hasattr(first, "device_mesh") else 0

        # the critic shards on the actor's mesh: 2D (replicate, shard) with fsdp_size=1; no FSDP2 with 0
        assert ray.get(group.workers[0].call.remote(mesh_dims)) == {-1: 1, 0: 0, 1: 2}[fsdp_size]
    finally:
        group.shutdown()
    # step 1 starts from the zero head: values 0, loss 0.5 * mean(G^2); step 2's values come from the
    # critic each side trained in step 1, so equal values there mean equal critic updates. fp32 sums in
    # other orders: relative error ~ sqrt(n) * eps per value, far under 1e-4
    assert one[0]["critic/values_mean"] == two[0]["critic/values_mean"] == 0.0
    assert abs(one[1]["critic/values_mean"]) > 1e-4, (
        "the critic must move for the comparison to mean something"
    )
    for key in (
        "critic/vf_loss",
        "critic/values_mean",
        "critic/returns_mean",
        "critic/grad_norm",
        "critic/vf_clipfrac",
    ):
        for a, b in zip(one, two, strict=True):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_lora_is_refused_with_a_clear_error(tiny_model_dir: Path) -> None:
    import torch.distributed as dist

    from trainer.distributed.data_parallel import ShardedActor

    cfg = TrainerConfig.from_dict(
        {
            "actor_rollout_ref": {"model": {"path": str(tiny_model_dir), "lora_rank": 4}},
            "trainer": {"device": "cpu"},
        }
    )
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="does not support LoRA"):
        ShardedActor(cfg, str(tiny_model_dir), "cpu", 0, 1)


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.parametrize(("estimator", "without_fsdp"), [("grpo", False), ("gae", False), ("gae", True)])
def test_ranks_checkpoint_in_safetensors_and_resume_the_same_step(
    tiny_model_dir: Path, ray_local: None, tmp_path: Path, estimator: str, without_fsdp: bool
) -> None:
    """2 ranks write a checkpoint as one device does (model.safetensors + optimizer.pt, no actor.pt) and
    the final model as a Hugging Face folder; a fresh group resumes from it and takes the same next step.
    Also with whole copies trained without FSDP2 (``skip_fsdp_when_replicated``)."""
    import anyio
    from transformers import AutoModelForCausalLM

    cfg = _config(
        tiny_model_dir,
        token_budget=40,
        estimator=estimator,
        fsdp_size=1 if without_fsdp else -1,
        skip_fsdp_when_replicated=without_fsdp,
    )
    batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
    path, final = tmp_path / "global_step_1", tmp_path / "final_model"
    path.mkdir()

    async def first() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
        await group.update.remote(batch)
        await group.save_checkpoint.remote(str(path))
        await group.save_model.remote(str(tiny_model_dir), str(final), None)
        saved = await group.named_weights.remote()
        metrics = await group.update.remote(batch)
        return saved, await group.named_weights.remote(), metrics

    async def resumed() -> tuple[int, dict[str, torch.Tensor], dict[str, float]]:
        step = await group.load_checkpoint.remote(str(path))
        metrics = await group.update.remote(batch)
        return step, await group.named_weights.remote(), metrics

    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        saved, expected, going_on = anyio.run(first)
    finally:
        group.shutdown()
    files = ["model.safetensors", "optimizer.pt"] + (["critic"] if estimator == "gae" else [])
    assert sorted(p.name for p in path.iterdir()) == sorted(files)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved if k in model.state_dict())
    group = DataParallelGroup.create(cfg, str(tiny_model_dir), "cpu", world_size=2)
    try:
        step, got, again = anyio.run(resumed)
    finally:
        group.shutdown()
    assert step == 1
    # the same ranks, the same data, the same restored weights and Adam moments: the same step exactly
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    if estimator == "gae":  # the critic too: the same values, loss and update after the resume
        for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/pg_loss"):
            assert again[key] == going_on[key], key


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shard_keeps_gathered_parameters_only_when_asked(
    tiny_model_dir: Path, reshard_after_forward: bool
) -> None:
    """After a forward, FSDP2 leaves a layer's parameters gathered (plain tensors) only with
    reshard_after_forward=False; resharded ones are DTensor shards again."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.distributed.data_parallel import shard
    from trainer.model.actor import load_policy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = load_policy(tiny_model_dir, torch.device("cpu"))
        layers = model.model.layers
        shard(model, layers, FSDPConfig(reshard_after_forward=reshard_after_forward))
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        gathered = not isinstance(layers[0].self_attn.q_proj.weight, DTensor)
        assert gathered is (not reshard_after_forward)
    finally:
        dist.destroy_process_group()


def test_an_exception_mid_mini_batch_leaves_gradient_sync_on(tiny_model_dir: Path) -> None:
    """With grad_sync_per_micro_batch=False a micro-batch that raises after an unsynced backward must not
    leave FSDP2's gradient sync off: the next backward reduce-scatters (1 gloo rank, in this process)."""
    import torch.distributed as dist

    from trainer.distributed.data_parallel import ShardedActor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = _config(tiny_model_dir, token_budget=32, grad_sync_per_micro_batch=False)
        actor = ShardedActor(cfg, str(tiny_model_dir), "cpu", 0, 1)
        batch, _ = build_batch(_triplets(), max_prompt_length=32, max_response_length=16)
        forward, calls = actor._forward, []

        def fails_second_training_forward(model: Any, mb: Any, entropy: bool) -> Any:
            if torch.is_grad_enabled():  # the update's micro-batches, not the log-prob passes
                calls.append(len(mb))
                if len(calls) == 2:
                    raise RuntimeError("a micro-batch failed")
            return forward(model, mb, entropy)

        actor._forward = fails_second_training_forward  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="a micro-batch failed"):
            actor.update(batch)
        assert len(calls) == 2, "the first micro-batch's backward ran unsynced before the failure"
        actor.optimizer.zero_grad(set_to_none=True)
        actor.model(input_ids=batch.input_ids[:1]).logits.float().sum().backward()
        params = [p for p in actor.model.parameters() if p.requires_grad]
        # reduced gradients land on the sharded parameters; unsynced ones stay inside FSDP2
        assert all(p.grad is not None for p in params), "gradient sync was left off after the exception"
    finally:
        dist.destroy_process_group()
