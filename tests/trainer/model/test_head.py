"""The chunked LM-head log-probs (trainer/model/head.py) against the plain logits path, values and gradients."""

from __future__ import annotations

import pytest
import torch

from trainer.algorithms import entropy_from_logits, logprobs_from_logits
from trainer.model.head import head_logprobs


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, 8, generator=g, dtype=torch.float64) * 2  # (b, R, d)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64)  # (V, d)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    return hidden, weight, ids


def _reference(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = hidden @ weight.T
    return logprobs_from_logits(logits, ids), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 4, 15, 64])
def test_values_equal_the_plain_path_for_any_chunking(chunk: int) -> None:
    hidden, weight, ids = _inputs()
    lp, ent = head_logprobs(hidden.float(), weight.float(), ids, chunk_tokens=chunk)
    ref_lp, ref_ent = _reference(hidden.float(), weight.float(), ids)
    # fp32 bounds for another order: the logits are d = 8 products summed in matmuls of other shapes
    # (z_err, worst case); M = logit range + log2 V bounds |z - max| and |log p|; p = exp(z - lse) has a
    # relative error up to eps * M, a sum over the V = 11 logits adds log2(V) * eps of its terms' size
    eps, log2_v, d = torch.finfo(torch.float32).eps, weight.shape[0].bit_length(), hidden.shape[-1]
    z_err = d * eps * float(hidden.abs().max() * weight.abs().max())
    mag = float((logits := hidden.float() @ weight.float().T).max() - logits.min()) + log2_v
    lp_atol = 2 * z_err + eps * (2 * mag + log2_v)  # logit - logsumexp
    # dH/dz = -p (log p + H) and sum(p |log p + H|) <= 2 H <= 2 log2 V; then lse - sum(p * z) as above
    ent_atol = 2 * log2_v * z_err + eps * mag * (mag + log2_v)
    torch.testing.assert_close(lp, ref_lp, atol=lp_atol, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=ent_atol, rtol=0)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_equal_autograd_through_the_logits(with_entropy: bool) -> None:
    hidden, weight, ids = _inputs(1)
    g = torch.Generator().manual_seed(2)
    coef_lp, coef_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    def loss(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        out = (lp * coef_lp).sum()
        return out + (ent * coef_ent).sum() if with_entropy else out

    h1, w1 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss(*head_logprobs(h1, w1, ids, chunk_tokens=4)).backward()
    h2, w2 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss(*_reference(h2, w2, ids)).backward()
    # d(loss)/dz carries p's relative error eps * (M + log2 V) (M: logit range + log2 V); a gradient sums
    # up to n = 15 such terms (rows for the weight, 11 logits for the hidden states), which may cancel:
    # error <= n * eps * (M + log2 V) of the largest gradient (norm-wise)
    log2_v = weight.shape[0].bit_length()
    mag = float((logits := hidden @ weight.T).max() - logits.min()) + log2_v
    grad_rel = 15 * torch.finfo(torch.float32).eps * (mag + log2_v)
    torch.testing.assert_close(h1.grad, h2.grad, atol=grad_rel * float(h2.grad.abs().max()), rtol=0)
    torch.testing.assert_close(w1.grad, w2.grad, atol=grad_rel * float(w2.grad.abs().max()), rtol=0)


def test_bf16_matmul_matches_bf16_logits() -> None:
    """compute_dtype=bf16 is what autocast gives the plain path: a bf16 matmul, fp32 statistics."""
    hidden, weight, ids = _inputs(3)
    lp, _ = head_logprobs(hidden.float(), weight.float(), ids, compute_dtype=torch.bfloat16)
    ref = logprobs_from_logits(hidden.bfloat16() @ weight.bfloat16().T, ids)
    # the same bf16 logits (one bf16 matmul of the same rows), then fp32 statistics in another order:
    # two values up to M = logit range + log2 V rounded, and the logsumexp's sum over V = 11
    eps, log2_v = torch.finfo(torch.float32).eps, weight.shape[0].bit_length()
    mag = float((logits := hidden.bfloat16() @ weight.bfloat16().T).max() - logits.min()) + log2_v
    torch.testing.assert_close(lp, ref, atol=eps * (2 * mag + log2_v), rtol=0)


def test_bad_shapes_are_rejected() -> None:
    hidden, weight, ids = _inputs()
    with pytest.raises(ValueError, match=r"hidden \(b, R, d\) and ids \(b, R\)"):
        head_logprobs(hidden[0], weight, ids)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        head_logprobs(hidden, weight, ids, chunk_tokens=0)
