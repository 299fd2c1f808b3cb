"""SFT's loss: the policy trained by token-level NLL on the recorded model tokens (response_mask 1)."""

from __future__ import annotations

import time

import torch

from trainer.algorithms import agg_loss, attempt_row_weights, loss_denominator
from trainer.batch import Batch
from trainer.model.actor import Actor


class SFTActor(Actor):
    """The policy and its optimizer, trained by NLL instead of a policy loss; the Actor's forward,
    micro-batching, warm-up, clipping, weights and checkpoints as they are."""

    def nll_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``: the NLL of its response_mask tokens (mask 0: tool output,
        template, padding: never trained), aggregated by ``actor.loss_agg_mode`` over the whole batch
        while micro-batches accumulate gradients."""
        actor = self.config.actor_rollout_ref.actor
        t0 = time.perf_counter()
        batch = batch.to(self.device)
        mask = batch.response_mask.bool()  # (B, R)
        agg = actor.loss_agg_mode
        denom = loss_denominator(mask, agg)  # one denominator for the batch: micro-batches add up to it
        if agg == "attempt-mean-token-mean":
            batch.extras["row_weights"] = attempt_row_weights(mask, batch.row_attempts())
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = {"sft/loss": torch.zeros((), device=self.device), "sft/tokens": mask.sum()}
        for mb, _rows in self._split_micro_batches(batch):
            logprobs, _ = self._forward(self.model, mb, entropy=False)  # (b, r)
            nll = agg_loss(
                -logprobs, mb.response_mask, agg, denominator=denom, row_weights=mb.extras.get("row_weights")
            )
            nll.backward()
            totals["sft/loss"] += nll.detach()
        metrics = self._apply_gradients(totals)
        self.step += 1
        elapsed = time.perf_counter() - t0
        return {
            **metrics,
            "sft/samples": float(len(batch)),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "timing/update_s": elapsed,
            "perf/update_tokens_per_s": sum(batch.rows_on_host().sequence_tokens()) / max(elapsed, 1e-9),
        }

    def mean_nll(self, batch: Batch) -> float:
        """Token-mean NLL of ``batch``'s response_mask tokens under the current weights (no gradient)."""
        batch = batch.to(self.device)
        logprobs = self.compute_logprobs(batch)  # (B, R), 0 where masked
        return float(-logprobs.sum() / batch.response_mask.sum().clamp(min=1))
