"""One optimizer step's tail: clip, read the metrics back once, warm the lr up, skip a non-finite step."""

from __future__ import annotations

import math

import torch
from structlog.testing import capture_logs

from trainer.config._actor import OptimConfig
from trainer.model._read_back import clip_and_read_back, clipped_step


def _param_with_grad(grad: list[float]) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad)
    return p


def test_clip_and_read_back_returns_the_norm_before_clipping_and_the_totals() -> None:
    p = _param_with_grad([3.0, 4.0])  # norm 5
    read, norm = clip_and_read_back([p], 1.0, {"a": torch.tensor(2.5), "n": torch.tensor(7)})
    assert norm == 5.0
    assert read == {"a": 2.5, "n": 7.0}
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]))  # clipped to norm 1


def test_clipped_step_warms_the_lr_up_and_steps() -> None:
    p = _param_with_grad([3.0, 4.0])
    opt = torch.optim.SGD([p], lr=0.1)
    read, norm = clipped_step(
        opt, [p], max_norm=1.0, optim=OptimConfig(lr=0.1, lr_warmup_steps=4), step=0, totals={}, role="actor"
    )
    assert (read, norm) == ({}, 5.0)
    assert opt.param_groups[0]["lr"] == 0.1 * 1 / 4  # first update of a 4-update warm-up
    torch.testing.assert_close(p.data, -0.025 * torch.tensor([0.6, 0.8]))  # the clipped gradient's step
    assert p.grad is None  # zeroed for the next mini-batch
    p.grad = torch.tensor([0.0, 0.0])
    clipped_step(
        opt, [p], max_norm=1.0, optim=OptimConfig(lr=0.1, lr_warmup_steps=4), step=9, totals={}, role="actor"
    )
    assert opt.param_groups[0]["lr"] == 0.1  # warm-up over: the configured lr


def test_a_non_finite_gradient_skips_the_step_and_says_so() -> None:
    p = _param_with_grad([math.inf, 1.0])
    opt = torch.optim.SGD([p], lr=0.1)
    with capture_logs() as logs:
        _, norm = clipped_step(
            opt,
            [p],
            max_norm=1.0,
            optim=OptimConfig(lr=0.1, lr_warmup_steps=4),
            step=0,
            totals={},
            role="critic",
        )
    assert opt.param_groups[0]["lr"] == 0.1  # no step, so no warm-up either
    assert not math.isfinite(norm)
    assert torch.equal(p.data, torch.zeros(2))  # no step taken
    assert p.grad is None  # the bad gradient is not carried into the next step
    assert [e["event"] for e in logs] == ["critic.skip_step_nonfinite_grad"]
