"""actor.cpu_autocast: bf16 autocast for the CPU update where asked (or where the CPU has native bf16),
fp32 otherwise; GPUs always bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.samples import actor_config, small_batch
from trainer import actor as actor_mod
from trainer.actor import Actor, uses_bf16


def test_the_setting_decides_on_cpu_and_gpus_always_use_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not uses_bf16(cpu, "off") and uses_bf16(cpu, "bf16")
    assert uses_bf16(cuda, "off") and uses_bf16(cuda, "auto")
    monkeypatch.setattr(actor_mod, "cpu_has_native_bf16", lambda: False)
    assert not uses_bf16(cpu, "auto")
    monkeypatch.setattr(actor_mod, "cpu_has_native_bf16", lambda: True)
    assert uses_bf16(cpu, "auto")


def test_a_bad_value_names_the_choices(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_autocast"):
        actor_config(tiny_model_dir, cpu_autocast="fp16")


def test_bf16_log_probs_are_bf16_rounded_and_the_update_trains(tiny_model_dir: Path) -> None:
    """With bf16 the log-probs differ from fp32's by bf16 rounding (not 0: the setting is really used),
    and an update still runs with finite metrics."""
    batch = small_batch()
    fp32 = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    bf16 = Actor(actor_config(tiny_model_dir, cpu_autocast="bf16"), tiny_model_dir, "cpu")
    assert not fp32.bf16 and bf16.bf16
    a, b = fp32.compute_logprobs(batch), bf16.compute_logprobs(batch)
    gap = float((a - b).abs().max())
    # bf16 keeps 8 mantissa bits: a log-prob's relative error is about 2**-8 per rounding, amplified
    # through a few layers; an fp32 run would give 0 here (same weights, same tokens, same machine)
    assert 0 < gap < 64 * 2**-8 * max(1.0, float(a.abs().max()))
    metrics = bf16.update(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["actor/optimizer_steps"] >= 1
