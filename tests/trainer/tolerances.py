"""Float32 tolerances derived from the computation (not tuned on one CPU), shared by the trainer tests that
compare two ways of taking the same step."""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps
ADAM_EPS = 1e-8  # AdamW's default eps, the trainer's


def gradient_noise(tokens: int, vocab_size: int, scale: float = 1.0) -> float:
    """How far two float32 computations of one clipped gradient may differ when they sum the same terms in
    other orders: ``tokens`` tokens, each back-propagated through sums over ``vocab_size`` logits, of terms
    up to ``scale`` (the clip norm): typical error (sqrt(tokens) + sqrt(vocab_size)) * eps * scale."""
    return (tokens**0.5 + vocab_size**0.5) * EPS32 * scale


def assert_one_adam_step_agrees(
    got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, *, lr: float, noise: float, what: str
) -> int:
    """``got`` and ``expected``, weights after one AdamW step from zero state from ``before``, whose
    gradients differ by at most ``noise``, agree as far as that allows.

    One step moves a weight by lr * g / (|g| + adam_eps): the full lr unless |g| is tiny. So a gradient
    within ``noise`` of 0 may flip sign (steps 2 * lr apart), while a larger one barely moves its step:
    by lr * (d/dg of g / (|g| + adam_eps)) * noise at most. |g| is bounded below from ``expected``'s step.
    Each run also rounds the weight (1 ulp) after ~8 operations of the step; x2 for the two runs.

    Returns how many weights the bound constrains (below 2 * lr): the test's power; the others' gradients
    are within the noise of 0. A gradient wrong by a uniform scale passes (clipping and Adam's first step
    cancel it): compare the gradient norms too. ``noise`` is a typical error, used as a hard bound."""
    rounding = 2 * EPS32 * (expected.abs() + 8 * lr)
    r = ((expected - before).abs() - rounding).clamp(min=0) / lr  # <= |g| / (|g| + adam_eps)
    g = ADAM_EPS * r / (1 - r).clamp(min=EPS32)  # a lower bound on the weight's |g|
    same_sign = lr * ADAM_EPS * noise / ((g + ADAM_EPS) * (g - noise + ADAM_EPS))
    bound = torch.where(g > noise, same_sign.clamp(max=2 * lr), torch.full_like(g, 2 * lr)) + rounding
    excess = (got - expected).abs() - bound
    i, worst = int(excess.argmax()), float(excess.max())
    assert worst <= 0, f"{what}: {got.flatten()[i]} vs {expected.flatten()[i]} (bound {bound.flatten()[i]})"
    return int((bound < 2 * lr).sum())
