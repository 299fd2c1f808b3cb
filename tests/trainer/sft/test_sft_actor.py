"""SFT's loss (trainer/sft/actor.py): the NLL of the response_mask tokens, nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentloop.types import Triplet
from trainer.sft.actor import SFTActor
from trainer.sft.config import load_configs
from trainer.sft.data import _batch

pytestmark = pytest.mark.timeout(600)


def _triplet(response: list[int], mask: list[int]) -> Triplet:
    return Triplet(
        prompt_ids=[1, 520, 33, 981, 4],
        response_ids=response,
        response_mask=mask,
        reward=1.0,
        metadata={"rollout_id": "r", "attempt_id": "a"},
    )


class _Probe(SFTActor):
    """Keeps the gradient of its last step (the optimizer step itself runs at lr 0)."""

    grads: torch.Tensor

    def _apply_gradients(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        self.grads = torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None])
        return super()._apply_gradients(totals)


def _loss_and_grad(actor: _Probe, t: Triplet) -> tuple[float, torch.Tensor]:
    batch, _ = _batch([[t]], actor.config, pad=2)
    loss = actor.nll_step(batch)["sft/loss"]
    return loss, actor.grads.clone()


def test_only_response_mask_tokens_make_the_loss(tiny_model_dir: Path) -> None:
    """The loss is the NLL of the mask-1 tokens (hand-computed from the plain forward), and masked tokens
    that nothing after them is conditioned on change neither the loss nor the gradient."""
    cfg, _ = load_configs(
        {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}}}
    )
    actor = _Probe(cfg, tiny_model_dir, "cpu")
    # the weights stay as they are between the calls (the lr cannot be 0: every step sets it from the config)
    actor.optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    response, mask = [77, 301, 12, 800, 801, 802, 55, 56, 900, 901], [1, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    t = _triplet(response, mask)
    batch, _ = _batch([[t]], cfg, pad=2)
    with torch.no_grad():
        logits = actor.model(input_ids=batch.input_ids).logits[0].float()  # (P+R, V)
    p = batch.prompt_length
    logp = torch.log_softmax(logits[p - 1 : p - 1 + len(response)], -1)  # (R, V) position t scores token t+1
    token_lp = logp[torch.arange(len(response)), torch.tensor(response)]
    expected = float(-(token_lp * torch.tensor(mask)).sum() / sum(mask))
    loss, grad = _loss_and_grad(actor, t)
    # the actor's forward (with its attention mask and position ids) and this one differ by float noise:
    # each logit sums ~1150 fp32 products along the tiny model's path, error sqrt(1150) * eps * |logit|,
    # |logit| <= 20, a log-prob twice that (tests/proxy/test_torch_engine.py); the mean keeps that bound
    assert loss == pytest.approx(expected, abs=2 * 1150**0.5 * torch.finfo(torch.float32).eps * 20)

    tail_changed = _triplet([*response[:8], 4000, 4001], mask)  # the last masked tokens differ
    loss2, grad2 = _loss_and_grad(actor, tail_changed)
    assert loss2 == loss and torch.equal(grad2, grad)
    model_changed = _triplet([78, *response[1:]], mask)  # a model token differs: the loss must notice
    assert _loss_and_grad(actor, model_changed)[0] != loss
