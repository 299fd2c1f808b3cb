"""Placement: the plan from the config and the check against the Ray cluster's resources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from trainer.config import TrainerConfig
from trainer.distributed.placement import PlacementError, check_cluster, plan_placement


def test_placement_plan_and_cluster_check() -> None:
    cfg = TrainerConfig.from_dict(
        {
            "actor_rollout_ref": {"rollout": {"replicas": 2}},
            "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
            "placement": {"colocate": False},
        }
    )
    plan = plan_placement(cfg, "cuda")
    assert (plan.train_ranks, plan.replicas, plan.gpus_needed) == (2, 2, 4)
    with pytest.raises(PlacementError, match=r"placement needs 4 GPUs .* but the Ray cluster has 2"):
        check_cluster(plan, {"GPU": 2.0, "CPU": 32.0}, alive_nodes=1)
    check_cluster(plan, {"GPU": 4.0}, alive_nodes=1)
    colocated = plan_placement(cfg.with_overrides(["placement.colocate=true"]), "cuda")
    assert colocated.gpus_needed == 2
    check_cluster(colocated, {"GPU": 2.0}, alive_nodes=1)
    two_nodes = plan_placement(cfg.with_overrides(["trainer.nnodes=2"]), "cuda")
    with pytest.raises(PlacementError, match=r"trainer\.nnodes=2 but the Ray cluster has 1 node"):
        check_cluster(two_nodes, {"GPU": 8.0}, alive_nodes=1)
    assert plan_placement(cfg, "cpu").gpus_needed == 0


def test_placement_config_is_validated() -> None:
    from agentloop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"placement\.train_ranks"):
        TrainerConfig.from_dict({"placement": {"train_ranks": 0}})
    with pytest.raises(ConfigError, match="did you mean 'colocate'"):
        TrainerConfig.from_dict({"placement": {"colocated": True}})
    cfg = TrainerConfig.from_dict({"trainer": {"nnodes": 2, "n_gpus_per_node": 4}})
    assert plan_placement(cfg, "cuda").train_ranks == 8
    assert plan_placement(cfg.with_overrides(["placement.train_ranks=2"]), "cpu").train_ranks == 2
    four = cfg.with_overrides(["placement.train_ranks=4"])
    for size in (-1, 1, 2, 4, 8):
        assert plan_placement(
            four.with_overrides([f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}"]), "cuda"
        )
    with pytest.raises(PlacementError, match=r"fsdp_size=3 must divide the 4 trainer rank\(s\)"):
        plan_placement(four.with_overrides(["actor_rollout_ref.actor.fsdp_config.fsdp_size=3"]), "cuda")
    with pytest.raises(
        ConfigError, match=r"fsdp_size.*must be -1 \(all ranks\) or a number of ranks >= 1, got 0"
    ):
        TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"fsdp_config": {"fsdp_size": 0}}}})
    with pytest.raises(
        ConfigError, match=r"layers_per_unit: Input should be greater than or equal to 1; got 0"
    ):
        TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"fsdp_config": {"layers_per_unit": 0}}}})
    with pytest.raises(TypeError, match="takes a TrainerConfig"):
        plan_placement({}, "cpu")  # type: ignore[arg-type]


def test_memory_counts_the_critic_beside_the_actor(tiny_model_dir: Path) -> None:
    from trainer.distributed.placement import check_memory, model_parameters, state_memory

    params = model_parameters(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert params == sum(p.numel() for p in model.parameters())  # a tied head counted once
    grpo = TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"n": 2}}})
    ppo = TrainerConfig.from_dict(
        {"algorithm": {"adv_estimator": "gae"}, "actor_rollout_ref": {"rollout": {"n": 2}}}
    )
    gib = 1024**3
    assert state_memory(grpo, tiny_model_dir, 1) == {
        "actor_gib": params * 16 / gib, "critic_gib": 0.0, "ref_gib": 0.0, "total_gib": params * 16 / gib
    }  # fmt: skip
    two = state_memory(ppo, tiny_model_dir, 2)  # the critic doubles the state; two ranks halve it
    assert two["critic_gib"] == two["actor_gib"] == params * 8 / gib
    fsdp_2 = ppo.with_overrides(["actor_rollout_ref.actor.fsdp_config.fsdp_size=2"])
    assert state_memory(fsdp_2, tiny_model_dir, 8)["actor_gib"] == params * 8 / gib  # 4 groups of 2 ranks
    kl = grpo.with_overrides(["actor_rollout_ref.actor.use_kl_loss=true"])
    assert state_memory(kl, tiny_model_dir, 4)["ref_gib"] == params * 4 / gib  # the reference is not sharded
    replicated = ppo.with_overrides(["actor_rollout_ref.actor.fsdp_config.fsdp_size=1"])
    assert state_memory(replicated, tiny_model_dir, 8)["actor_gib"] == params * 16 / gib  # a copy a rank
    plan = plan_placement(ppo, "cuda")
    tight = 1.5 * params * 16 / gib  # the actor alone fits, actor + critic do not
    check_memory(grpo, tiny_model_dir, plan, tight)
    with pytest.raises(PlacementError, match=r"actor .*critic .*more trainer ranks"):
        check_memory(ppo, tiny_model_dir, plan, tight)


def test_worker_env_keeps_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.distributed.placement import MALLOC_ENV, worker_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert worker_env() == MALLOC_ENV
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert worker_env() == {"MALLOC_TRIM_THRESHOLD_": MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]}


@pytest.mark.e2e
def test_ray_workers_start_with_the_malloc_settings(tmp_path: Path) -> None:
    """init_ray's local Ray starts its workers with glibc's fixed mmap and trim thresholds (read by glibc
    at process start, so only a worker's environment can carry them); a value the user set wins."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, ray\n"
        "from trainer.config import TrainerConfig\n"
        "from trainer.distributed.placement import init_ray\n"
        "init_ray(TrainerConfig())\n"
        "@ray.remote(num_cpus=0)\n"
        "def env():\n"
        "    return {k: os.environ.get(k) for k in ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_')}\n"
        "print(json.dumps(ray.get(env.remote())))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env |= {"MALLOC_TRIM_THRESHOLD_": "123456", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240, check=True
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "123456"}


@pytest.mark.e2e
def test_a_ray_started_on_the_ray_thread_outlives_the_call(tmp_path: Path) -> None:
    """Ray's processes die with the thread that started them (PR_SET_PDEATHSIG): a Ray started by
    ``on_ray_thread`` is still serving after the call returned, and the process's SIGTERM handler is
    left as it was (Ray sets its own only from the main thread)."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, signal, time, ray\n"
        "from trainer.config import TrainerConfig\n"
        "from trainer.distributed.placement import init_ray, on_ray_thread\n"
        "before = signal.getsignal(signal.SIGTERM)\n"
        "on_ray_thread(lambda: init_ray(TrainerConfig())).result(timeout=120)\n"
        "time.sleep(3)\n"
        "@ray.remote(num_cpus=0)\n"
        "def square(x):\n"
        "    return x * x\n"
        "print(json.dumps({'square': ray.get(square.remote(7), timeout=60),\n"
        "                  'sigterm_kept': signal.getsignal(signal.SIGTERM) is before}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"square": 49, "sigterm_kept": True}
    assert "SIGTERM handler is not set" not in done.stderr
