"""actor/entropy is the token-mean entropy of every trained token of the mini-batch, also of the samples
the loss skips because they carry no advantage (a GRPO group whose attempts scored alike).

The reference is verl: its ``actor/entropy`` is ``agg_loss(entropys, response_mask, loss_agg_mode)`` over
every response token of the batch (``compute_log_prob`` in ``ray_trainer.py``), whatever the rewards.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from agentloop.types import Triplet
from tests.trainer.samples import actor_config
from trainer.batch import Batch, build_batch
from trainer.model.actor import Actor

# Each row repeats one token, and the model below gives the token that follows token t a uniform
# distribution over K[t] tokens: every scored position of a row has entropy ln K[t] (t's own row).
# Rows: (token, prompt tokens, response tokens, reward, group). Group 1 scored alike: no advantage.
ROWS = [(10, 3, 4, 1.0, 0), (11, 2, 2, 0.0, 0), (12, 3, 5, 1.0, 1), (13, 2, 3, 1.0, 1)]
K = {10: 2, 11: 4, 12: 8, 13: 16}  # entropies ln 2, 2 ln 2, 3 ln 2, 4 ln 2
# (4 x 1 + 2 x 2 + 5 x 3 + 3 x 4) ln 2 over 4 + 2 + 5 + 3 = 14 tokens
TOKEN_MEAN = 35 / 14 * math.log(2)  # 1.7329
LOGIT = 40.0  # the K favoured tokens' logit, 0 for the others: 49152 e^-40 = 2e-13 of the mass is left out


def _uniform_over_k_model(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model made to give, after token t, logit LOGIT to K[t] tokens and 0 to every other.

    Attention and MLP outputs are zeroed, so the final hidden state at a position is the final norm of
    its token's embedding: e_i for the i-th token of K (a unit basis vector) normalised to sqrt(d) e_i
    (RMS norm, weight 1, eps 1e-5: a factor 1 / sqrt(1/d + eps) = 7.9975 for d = 64). The untied head's
    column i holds LOGIT / 7.9975 in K[t] rows, so those logits are LOGIT and the rest 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = model.config
    d = cfg.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = torch.zeros(cfg.vocab_size, d)
        head = torch.zeros(cfg.vocab_size, d)
        scale = 1 / math.sqrt(1 / d + cfg.rms_norm_eps)
        for i, (token, k) in enumerate(K.items()):
            embed[token, i] = 1.0
            head[100 * (i + 1) : 100 * (i + 1) + k, i] = LOGIT / scale
        model.model.embed_tokens.weight.copy_(embed)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _batch(rewards: list[float] | None = None) -> Batch:
    triplets = [
        Triplet(
            prompt_ids=[token] * prompt,
            response_ids=[token] * response,
            reward=reward if rewards is None else rewards[i],
            metadata={"group_id": group},
        )
        for i, (token, prompt, response, reward, group) in enumerate(ROWS)
    ]
    return build_batch(triplets, max_prompt_length=32, max_response_length=16)[0]


@pytest.fixture(scope="module")
def uniform_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _uniform_over_k_model(tiny_model_dir, tmp_path_factory.mktemp("uniform-over-k"))


def _atol(tokens: int, per_value: int = 1) -> float:
    """Each token's entropy is logsumexp - sum(p z) in float32 over logits up to LOGIT: a few ulps of
    LOGIT + ln K (8 eps M), plus the 2e-13 of the mass left out. An aggregate sums ``tokens`` of them, and
    each value it averages adds up to ``per_value`` token entropies (a row's under seq-mean-token-sum),
    each sum rounding once per term of up to per_value x 4 ln 2."""
    eps = torch.finfo(torch.float32).eps
    return per_value * (8 * eps * (LOGIT + math.log(16)) + tokens * eps * 4 * math.log(2))


def test_the_model_gives_each_row_its_hand_computed_entropy(uniform_model: Path) -> None:
    """The setup the other tests stand on: row t's tokens have entropy ln K[t]."""
    actor = Actor(actor_config(uniform_model), uniform_model, "cpu")
    batch = _batch()
    with torch.no_grad():
        _, ent = actor._forward(actor.model, batch, entropy=True)
    assert ent is not None
    for row, (token, _, response, _, _) in enumerate(ROWS):
        want = torch.full((response,), math.log(K[token]))
        torch.testing.assert_close(ent[row, :response], want, atol=_atol(1), rtol=0)


@pytest.mark.parametrize(
    ("rewards", "active"),
    [
        (None, 2.0),  # group 1 scored alike: its rows carry no advantage and are not trained
        ([1.0, 1.0, 0.0, 0.0], 0.0),  # both groups alike: no row trained, no step
        ([1.0, 0.0, 1.0, 0.0], 4.0),  # every row trained
    ],
)
def test_entropy_counts_the_rows_without_signal(
    uniform_model: Path, rewards: list[float] | None, active: float
) -> None:
    """(4 ln 2 + 2 x 2 ln 2 + 5 x 3 ln 2 + 3 x 4 ln 2) / 14 = 2.5 ln 2 = 1.7329 in every case. Before the fix
    the skipped rows' entropy was left out of a sum still divided by all 14 tokens: 8/14 ln 2 = 0.396
    with group 1 alike, and 0 with both alike; the mean over the trained rows only would be 4/3 ln 2.
    One micro-batch per row (token budget 8), so the sum over micro-batches is checked too."""
    actor = Actor(actor_config(uniform_model, ppo_max_token_len_per_gpu=8), uniform_model, "cpu")
    metrics = actor.update(_batch(rewards))
    assert metrics["actor/active_samples"] == active
    assert metrics["actor/entropy"] == pytest.approx(TOKEN_MEAN, abs=_atol(14))


@pytest.mark.parametrize(
    ("agg", "expected", "per_value"),
    [
        ("seq-mean-token-mean", 2.5 * math.log(2), 1),  # (1 + 2 + 3 + 4) ln 2 / 4 rows
        (
            "seq-mean-token-sum",
            35 / 4 * math.log(2),
            5,
        ),  # (4 + 4 + 15 + 12) ln 2 / 4 rows; rows up to 5 tokens
    ],
)
def test_entropy_follows_the_loss_aggregation(
    uniform_model: Path, agg: str, expected: float, per_value: int
) -> None:
    """verl aggregates the logged entropy as the loss: with the rows left out, each mode still averages
    over every row of the mini-batch."""
    actor = Actor(actor_config(uniform_model, loss_agg_mode=agg), uniform_model, "cpu")
    metrics = actor.update(_batch())
    assert metrics["actor/active_samples"] == 2.0
    assert metrics["actor/entropy"] == pytest.approx(expected, abs=_atol(14, per_value))


@pytest.mark.parametrize("without_fsdp", [False, True])
def test_sharded_actor_counts_the_rows_without_signal(uniform_model: Path, without_fsdp: bool) -> None:
    """The data-parallel actor (FSDP2 on 1 gloo rank in this process, and the whole copy trained without
    it) shares the single actor's step, and logs the same 2.5 ln 2 (before the fix: 8/14 ln 2)."""
    import torch.distributed as dist

    from trainer.distributed.data_parallel import ShardedActor

    fsdp = "actor_rollout_ref.actor.fsdp_config"
    config = actor_config(uniform_model, ppo_max_token_len_per_gpu=8).with_overrides(
        [f"{fsdp}.fsdp_size=1", f"{fsdp}.skip_fsdp_when_replicated={without_fsdp}"]
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        actor = ShardedActor(config, str(uniform_model), "cpu", 0, 1)
        metrics: dict[str, Any] = actor.update(_batch())
    finally:
        dist.destroy_process_group()
    assert metrics["actor/active_samples"] == 2.0
    assert metrics["actor/entropy"] == pytest.approx(TOKEN_MEAN, abs=_atol(14))


def _updates_in_rank(rank: int, port: int, model: str, out: Any) -> None:
    """One of two gloo ranks: a ShardedActor (FSDP2) updates on ``_batch`` with both groups scored alike
    (no step: the weights stay), then with group 1 alike; puts both updates' metrics."""
    import torch.distributed as dist

    from trainer.distributed.data_parallel import ShardedActor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        actor = ShardedActor(actor_config(Path(model), ppo_max_token_len_per_gpu=8), model, "cpu", rank, 2)
        out.put([actor.update(_batch(rewards)) for rewards in ([1.0, 1.0, 0.0, 0.0], None)])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~50 s on 2 cores; one rank without FSDP2 is in the fast tests
def test_two_ranks_count_the_rows_without_signal(uniform_model: Path) -> None:
    """Two FSDP2 ranks deal the skipped rows' forward between them (padded to the same count, or the
    ranks' all-gathers would not pair up) and sum their shares: 2.5 ln 2 on every rank, with no row
    trained and with group 1's rows left out (before the fix: 0 and 8/14 ln 2)."""
    import multiprocessing
    import queue

    from trainer.distributed.data_parallel import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_updates_in_rank, args=(r, port, str(uniform_model), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    except queue.Empty:
        pytest.fail(f"a rank gave no result in 120 s (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    for alike, mixed in results:
        assert (alike["actor/active_samples"], mixed["actor/active_samples"]) == (0.0, 2.0)
        for metrics in (alike, mixed):
            assert metrics["actor/entropy"] == pytest.approx(TOKEN_MEAN, abs=_atol(14))
