"""TrainerConfig: verl key names, defaults, clear errors for unknown keys and bad values, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

import trainer
from agentloop.errors import AgentLoopError, ConfigError
from trainer import algorithms
from trainer.config import TrainerConfig


def test_package_exports() -> None:
    assert trainer.__all__ == ["FitResult", "Trainer", "TrainerConfig", "sample_advantages"]
    assert trainer.TrainerConfig is TrainerConfig
    from trainer.batch.advantages import sample_advantages

    assert trainer.sample_advantages is sample_advantages


def test_defaults_are_valid_and_use_verl_names() -> None:
    cfg = TrainerConfig()
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == cfg.actor_rollout_ref.actor.clip_ratio_high == 0.2
    assert cfg.actor_rollout_ref.rollout.n >= 2
    assert cfg.trainer.run_dir == Path("runs/agentloop/default")
    assert cfg.adapter.credit_assignment == "identical"
    assert TrainerConfig.from_dict(None) == cfg
    assert TrainerConfig.from_dict(cfg) is cfg


def test_every_field_has_a_description_and_a_default() -> None:
    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            assert f.description, f"{prefix}{name} has no description"
            assert not f.is_required(), f"{prefix}{name} has no default"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")

    walk(TrainerConfig, "")


def test_unknown_key_names_the_closest_valid_one_and_the_path() -> None:
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"optim": {"learning_rate": 1e-5}}}})
    assert str(e.value) == "unknown key 'actor_rollout_ref.actor.optim.learning_rate'; did you mean 'lr'?"
    assert isinstance(e.value, AgentLoopError) and isinstance(e.value, ValueError)
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.loger'; did you mean 'logger'\?"):
        TrainerConfig.from_dict({"trainer": {"loger": ["console"]}})
    with pytest.raises(ConfigError, match=r"unknown key 'reward_model'; valid keys here: actor_rollout_ref"):
        TrainerConfig.from_dict({"reward_model": {"enable": True}})


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("algorithm.kl_penalty", algorithms.KL_KINDS),
        ("actor_rollout_ref.actor.kl_loss_type", algorithms.KL_KINDS),
        ("actor_rollout_ref.actor.loss_agg_mode", algorithms.LOSS_AGG_MODES),
    ],
)
def test_kl_and_aggregation_names_are_the_algorithms_own(key: str, names: tuple[str, ...]) -> None:
    # the config's Literal types are the ones trainer/algorithms/__init__.py defines: every name is accepted,
    # and a wrong one is refused with the list of valid names
    for name in names:
        TrainerConfig().with_overrides([f"{key}={name}"])
    with pytest.raises(ConfigError) as e:
        TrainerConfig().with_overrides([f"{key}=nope"])
    msg = str(e.value)
    assert msg.startswith(f"{key}: Input should be ") and msg.endswith("; got 'nope'"), msg
    assert all(f"'{name}'" in msg for name in names), msg


def test_bad_values_name_the_key_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict(
            {
                "algorithm": {"adv_estimator": "gpro"},
                "actor_rollout_ref": {"actor": {"loss_agg_mode": "sum", "clip_ratio_c": 0.5}},
                "trainer": {"logger": ["console", "tb"], "device": "gpu"},
            }
        )
    msg = str(e.value)
    assert "algorithm.adv_estimator: must be one of gae, grpo, reinforce_plus_plus" in msg
    assert "got 'gpro'" in msg
    assert "actor_rollout_ref.actor.loss_agg_mode: Input should be 'token-mean', 'seq-mean-token-sum'" in msg
    assert "actor_rollout_ref.actor.clip_ratio_c: Input should be greater than 1; got 0.5" in msg
    assert "trainer.logger[1]: Input should be 'console', 'jsonl', 'tensorboard' or 'wandb'; got 'tb'" in msg
    assert "trainer.device: must be auto, cpu, cuda or cuda:N; got 'gpu'" in msg
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref.actor.policy_loss: must be one of gspo, pg, vanilla"
    ):
        TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"policy_loss": "ppo"}}})
    with pytest.raises(ConfigError, match=r"clip_ratio_low: Input should be greater than 0; got -0.1"):
        TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"clip_ratio_low": -0.1}}})
    with pytest.raises(ConfigError, match="must be a dict or TrainerConfig, got list"):
        TrainerConfig.from_dict([1])  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"placement.cpu_binding: Input should be 'none', 'numa' or 'exclusive'; got 'fast'"
    ):
        TrainerConfig.from_dict({"placement": {"cpu_binding": "fast"}})


def test_batch_sizes_must_divide_and_the_message_says_which_numbers() -> None:
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict(
            {"data": {"train_batch_size": 30}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8}}}
        )
    assert str(e.value).startswith(
        "data.train_batch_size (30) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (8)"
    )
    assert "a step's 30 prompts (120 samples with rollout.n=4)" in str(e.value)
    assert "3 mini-batch(es) of 8 prompts (32 samples) and 6 left over" in str(e.value)
    assert str(e.value).endswith("set ppo_mini_batch_size to a divisor of 30, such as 6")
    # issue 15: train_batch_size 4 said "a step's 16 samples ... split into mini-batches of 32"
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict({"data": {"train_batch_size": 4}})  # ppo_mini_batch_size 8 by default
    assert "a step's 4 prompts (16 samples with rollout.n=4) cannot fill one mini-batch of 8 prompts" in str(
        e.value
    )
    assert "split into" not in str(e.value) and str(e.value).endswith("such as 4")
    with pytest.raises(
        ConfigError, match=r"a mini-batch of 32 samples .*\.ppo_micro_batch_size_per_gpu \(5\)"
    ):
        TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 5}}})
    ok = TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 8}}})
    assert ok.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8


def test_group_estimators_need_several_responses_per_prompt() -> None:
    with pytest.raises(
        ConfigError, match=r"'grpo' compares the responses .*\.rollout\.n must be >= 2, got 1"
    ):
        TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"n": 1}}})
    cfg = TrainerConfig.from_dict(
        {"algorithm": {"adv_estimator": "reinforce_plus_plus"}, "actor_rollout_ref": {"rollout": {"n": 1}}}
    )
    assert cfg.actor_rollout_ref.rollout.n == 1


def test_clip_ratios_follow_clip_ratio_unless_set_like_verl() -> None:
    cfg = TrainerConfig.from_dict(
        {"actor_rollout_ref": {"actor": {"clip_ratio": 0.3, "clip_ratio_high": None}}}
    )
    assert (cfg.actor_rollout_ref.actor.clip_ratio_low, cfg.actor_rollout_ref.actor.clip_ratio_high) == (
        0.3,
        0.3,
    )
    cfg = cfg.with_overrides(["actor_rollout_ref.actor.clip_ratio_high=0.28"])
    assert (cfg.actor_rollout_ref.actor.clip_ratio_low, cfg.actor_rollout_ref.actor.clip_ratio_high) == (
        0.3,
        0.28,
    )


def test_verl_nested_policy_loss_form_is_accepted() -> None:
    cfg = TrainerConfig.from_dict({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gspo"}}}})
    assert cfg.actor_rollout_ref.actor.policy_loss == "gspo"


def test_dotted_overrides_parse_values_as_yaml() -> None:
    base = TrainerConfig()
    cfg = base.with_overrides(
        [
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "trainer.logger=[console, tensorboard]",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "trainer.ray_address=null",
            "data.max_response_length = 64",
            "trainer.experiment_name=run=2",
        ]
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
    assert cfg.trainer.ray_address is None
    assert cfg.data.max_response_length == 64
    assert cfg.trainer.experiment_name == "run=2"
    assert base.actor_rollout_ref.actor.optim.lr == 1e-6  # the original is untouched


def test_bad_overrides_are_explained() -> None:
    cfg = TrainerConfig()
    with pytest.raises(
        ConfigError, match=r"unknown key 'actor_rollout_ref.actor.optimizer'; did you mean 'optim'"
    ):
        cfg.with_overrides(["actor_rollout_ref.actor.optimizer.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"'data\.train_batch_size' is a value, not a section"):
        cfg.with_overrides(["data.train_batch_size.x=3"])
    with pytest.raises(ConfigError, match=r"must look like dotted\.key=value"):
        cfg.with_overrides(["data.train_batch_size"])
    with pytest.raises(ConfigError, match=r"a list of 'dotted\.key=value' strings"):
        cfg.with_overrides("data.train_batch_size=2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the value is not valid YAML"):
        cfg.with_overrides(["trainer.logger=[console"])


def test_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("data:\n  train_batch_size: 16\nactor_rollout_ref:\n  rollout:\n    n: 8\n")
    cfg = TrainerConfig.from_yaml(path)
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (16, 8)
    with pytest.raises(ConfigError, match="does not exist"):
        TrainerConfig.from_yaml(tmp_path / "missing.yaml")
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        TrainerConfig.from_yaml(path)


def test_a_registered_estimator_becomes_a_valid_config_value() -> None:
    @algorithms.register_adv_estimator("test_config_estimator")
    def _est(rewards: torch.Tensor, response_mask: torch.Tensor, **_: object) -> algorithms.AdvantageOutput:
        zeros = torch.zeros(response_mask.shape)
        return algorithms.AdvantageOutput(zeros, zeros)

    cfg = TrainerConfig.from_dict({"algorithm": {"adv_estimator": "test_config_estimator"}})
    assert cfg.algorithm.adv_estimator == "test_config_estimator"


def test_engine_kwargs_follow_the_configured_backend() -> None:
    """Trainer.fit and the replica pool build the engine the config names (vLLM gets its memory share)."""
    from trainer.config import engine_kwargs

    torch_cfg = TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"engine_backend": "torch"}}})
    assert engine_kwargs(torch_cfg.actor_rollout_ref.rollout) == {
        "backend": "torch",
        "weight_update_policy": "drain",
        "idle_graph_capture": True,
    }
    lazy = TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"idle_graph_capture": False}}})
    assert engine_kwargs(lazy.actor_rollout_ref.rollout)["idle_graph_capture"] is False
    inflight = TrainerConfig.from_dict(
        {"actor_rollout_ref": {"rollout": {"weight_update_policy": "inflight"}}}
    )
    assert engine_kwargs(inflight.actor_rollout_ref.rollout)["weight_update_policy"] == "inflight"
    with pytest.raises(ValueError, match="weight_update_policy"):
        TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"weight_update_policy": "later"}}})
    vllm_cfg = TrainerConfig.from_dict(
        {"actor_rollout_ref": {"rollout": {"engine_backend": "vllm", "gpu_memory_utilization": 0.3}}}
    )
    assert engine_kwargs(vllm_cfg.actor_rollout_ref.rollout) == {
        "backend": "vllm",
        "weight_update_policy": "drain",
        "gpu_memory_utilization": 0.3,
    }
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"gpu_memory_utilization": 1.5}}})


def test_validation_is_greedy_by_default_with_verls_val_kwargs() -> None:
    """issue 15: validation sampled at the training temperature (the same model scored 0.2, then 0.1)."""
    val = TrainerConfig().actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.top_p, val.top_k, val.n, val.do_sample) == (0.0, 1.0, -1, 1, False)
    assert val.sampling() == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    cfg = TrainerConfig().with_overrides(
        [
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
            "actor_rollout_ref.rollout.val_kwargs.top_k=20",
        ]
    )
    assert cfg.actor_rollout_ref.rollout.val_kwargs.sampling()["temperature"] == 0.0  # do_sample false
    cfg = cfg.with_overrides(["actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    assert cfg.actor_rollout_ref.rollout.val_kwargs.sampling() == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 20,
    }
    assert TrainerConfig().trainer.val_before_train is True


def test_every_wait_has_a_configurable_deadline() -> None:
    timeouts = TrainerConfig().trainer.timeouts
    assert set(timeouts.model_dump()) == {
        "rollouts_s",
        "runner_s",
        "engine_s",
        "update_s",
        "weight_sync_s",
        "save_s",
    }
    assert all(v >= 60 for v in timeouts.model_dump().values())  # generous: they catch hangs, not slow steps
    cfg = TrainerConfig().with_overrides(["trainer.timeouts.rollouts_s=5"])
    assert cfg.trainer.timeouts.rollouts_s == 5
    with pytest.raises(ConfigError, match=r"trainer.timeouts.rollouts_s: Input should be greater than 0"):
        TrainerConfig().with_overrides(["trainer.timeouts.rollouts_s=0"])


def test_agent_rollouts_have_a_deadline_that_every_rollout_gets() -> None:
    """issue 16: training rollouts had no timeout_s, so one hung agent held the step forever."""
    from trainer.fit.trainer import rollout_config

    cfg = TrainerConfig()
    assert cfg.actor_rollout_ref.rollout.agent_timeout_s == 600.0
    assert rollout_config(cfg).timeout_s == 600.0 and rollout_config(cfg).max_attempts == 2
    cfg = cfg.with_overrides(["actor_rollout_ref.rollout.agent_timeout_s=30"])
    assert rollout_config(cfg).timeout_s == 30.0
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref.rollout.agent_timeout_s: Input should be greater than 0"
    ):
        TrainerConfig().with_overrides(["actor_rollout_ref.rollout.agent_timeout_s=0"])


async def test_rollout_proxy_workers_reach_the_fits_proxy(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agentloop.engine.torch.engine import TorchEngine
    from agentloop.proxy.workers import ProxyWorkers
    from agentloop.store.memory import MemoryStore
    from agentloop.store.sqlite import SQLiteStore
    from trainer.fit.trainer import training_proxy

    engine = TorchEngine(tiny_model_dir)  # not started: the proxy is only built
    store = SQLiteStore(tmp_path / "store.db")
    try:
        for workers in (0, 3):
            cfg = TrainerConfig.model_validate({"actor_rollout_ref": {"rollout": {"proxy_workers": workers}}})
            proxy = training_proxy(cfg, engine, store, record_sessions=True)
            pool = proxy._workers
            assert (pool.count if isinstance(pool, ProxyWorkers) else 0) == workers
        cfg = TrainerConfig.model_validate({"actor_rollout_ref": {"rollout": {"proxy_workers": 2}}})
        with pytest.raises(ValueError, match="SQLiteStore"):  # a store one process holds cannot be shared
            training_proxy(cfg, engine, MemoryStore(), record_sessions=True)
        with pytest.raises(ValueError, match="proxy_workers"):
            TrainerConfig.model_validate({"actor_rollout_ref": {"rollout": {"proxy_workers": -1}}})
    finally:
        await store.close()


def test_fsdp_mixed_precision_takes_verls_dtype_names() -> None:
    from trainer.distributed._sharding import mixed_precision_policy

    fsdp = TrainerConfig().actor_rollout_ref.actor.fsdp_config
    assert (fsdp.mixed_precision.param_dtype, fsdp.mixed_precision.reduce_dtype) == ("fp32", "fp32")
    assert mixed_precision_policy(fsdp.mixed_precision) is None  # FSDP2's own fp32 path
    key = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
    cfg = TrainerConfig().with_overrides([f"{key}.param_dtype=bfloat16", f"{key}.reduce_dtype=BF16"])
    policy = mixed_precision_policy(cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    cfg = TrainerConfig().with_overrides([f"{key}.reduce_dtype=bf16"])
    policy = mixed_precision_policy(cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.bfloat16)  # None: the fp32 params
    with pytest.raises(
        ConfigError, match=rf"{key}.param_dtype: must be fp32 or bf16 .*got 'fp16'; fp16 is not supported"
    ):
        TrainerConfig().with_overrides([f"{key}.param_dtype=fp16"])
    with pytest.raises(ConfigError, match=rf"{key}.reduce_dtype: must be fp32 or bf16 .*got True$"):
        TrainerConfig().with_overrides([f"{key}.reduce_dtype=true"])
    assert TrainerConfig().with_overrides([f"{key}.reduce_dtype=32"]) == TrainerConfig()  # verl's 32
    assert TrainerConfig().with_overrides([f"{key}=null"]) == TrainerConfig()  # verl's "the defaults"
    verl_block = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    verl = TrainerConfig.from_dict(  # verl's default block reads as it is written there
        {"actor_rollout_ref": {"actor": {"fsdp_config": {"mixed_precision": verl_block}}}}
    )
    assert verl.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "bf16"
    with pytest.raises(
        ConfigError, match=rf"{key}.buffer_dtype: must be fp32 .*got 'bfloat16'; FSDP2 has no buffer cast"
    ):
        TrainerConfig().with_overrides([f"{key}.buffer_dtype=bfloat16"])


def test_replicas_without_fsdp_need_a_whole_copy_a_rank_and_fp32_parameters() -> None:
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    on = f"{fsdp}.skip_fsdp_when_replicated=true"

    def without_fsdp(overrides: list[str], ranks: int) -> bool:
        return (
            TrainerConfig()
            .with_overrides(overrides)
            .actor_rollout_ref.actor.fsdp_config.replicated_without_fsdp(ranks)
        )

    assert without_fsdp([on, f"{fsdp}.fsdp_size=1"], 4)
    assert without_fsdp([on, f"{fsdp}.fsdp_size=1"], 1)
    assert not without_fsdp([on], 2)  # fsdp_size -1: sharded over the 2 ranks, FSDP2
    assert not without_fsdp([on, f"{fsdp}.fsdp_size=2"], 4)  # HSDP: FSDP2
    assert without_fsdp([on], 1)  # one rank: nothing to shard
    assert not without_fsdp([f"{fsdp}.fsdp_size=1"], 4)  # off by default
    # bf16 parameters are FSDP2's copies: it stays
    assert not without_fsdp([on, f"{fsdp}.fsdp_size=1", f"{fsdp}.mixed_precision.param_dtype=bf16"], 4)


def test_max_trajectory_length_must_hold_one_call() -> None:
    cfg = TrainerConfig.from_dict({"data": {"max_prompt_length": 100, "max_response_length": 20}})
    assert cfg.data.row_tokens == 120  # default: one call's prompt + response
    wide = {"data": {"max_prompt_length": 100, "max_response_length": 20, "max_trajectory_length": 4096}}
    assert TrainerConfig.from_dict(wide).data.row_tokens == 4096
    with pytest.raises(ConfigError, match=r"max_trajectory_length \(119\) must be at least .* \(120\)"):
        TrainerConfig.from_dict({"data": {**wide["data"], "max_trajectory_length": 119}})
