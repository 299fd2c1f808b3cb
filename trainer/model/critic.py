"""The critic: a value model trained beside the actor for PPO with GAE (verl's critic worker).

``ValueModel`` is a causal LM's decoder (the actor's model by default, ``critic.model.path``) with a
scalar head: V(s_t) for each response token t is read from the hidden state at the position that
scores the token (the state before the model emits it), as the actor reads its log-probs. The head
starts at zero, so the first values are 0 and the first advantages are the whitened returns.

``Critic.values`` computes the values of a batch once before the update; ``trainer.batch.advantages.
attempt_gae`` turns them and the rewards into advantages and returns; ``Critic.update`` then fits
the values to the returns with PPO's clipped value loss (``trainer.algorithms.value_loss``) over
``ppo_epochs`` passes of group mini-batches, with its own AdamW state, gradient clipping and the
actor's micro-batching; the actor's update follows (after ``trainer.critic_warmup`` steps).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from trainer.algorithms import explained_variance, loss_denominator, masked_mean, value_loss
from trainer.batch import Batch
from trainer.batch.splits import micro_batches_with_rows, split_by_groups
from trainer.config import TrainerConfig
from trainer.model import compiled
from trainer.model._read_back import clipped_step
from trainer.model.attention_mask import attention_mask_for
from trainer.model.hidden import shared_prompt_hidden
from trainer.model.policy_model import load_policy

_LOSS_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


class ValueModel(nn.Module):
    """A causal LM's decoder with a scalar value head (zero-initialised)."""

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        hf: Any = causal_lm
        self.decoder: nn.Module = hf.get_decoder()
        self.config = hf.config
        self.value_head = nn.Linear(int(self.config.hidden_size), 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb: Batch, shared_prompts: bool = False) -> torch.Tensor:
        """Values (b, R) at the positions that score the response tokens (float32)."""
        p, r = mb.prompt_length, mb.response_length
        hidden = None
        if shared_prompts:
            hidden = shared_prompt_hidden(
                self.decoder,
                mb.input_ids,
                mb.attention_mask,
                mb.position_ids,
                p,
                r,
                mb.rows_on_host().prompt_ids,
                mb.prompts_unpadded(),
            )
        if hidden is None:
            hidden = self.decoder(
                input_ids=mb.input_ids,
                attention_mask=attention_mask_for(self.decoder, mb.attention_mask, mb.fully_real()),
                position_ids=mb.position_ids,
                use_cache=False,
            ).last_hidden_state[:, p - 1 : p + r - 1]  # (b, R, d)
        return (
            cast(torch.Tensor, self.value_head(hidden.to(self.value_head.weight.dtype))).squeeze(-1).float()
        )


def load_value_model(path: str | Path, device: torch.device) -> ValueModel:
    """The value model on ``path``'s causal LM (its LM head is dropped), in float32 on ``device``."""
    lm = load_policy(path, device)
    model = ValueModel(lm).to(device)
    del lm  # the LM head is not part of the value model
    return model


class Critic:
    """Owns the value model and its optimizer; ``values`` before the update, ``update`` to fit."""

    def __init__(
        self,
        config: TrainerConfig,
        model_path: str | Path,
        device: torch.device,
        shared_prompts: bool = False,
    ) -> None:
        self.config = config
        self.device = device
        cc = config.critic
        self.model = load_value_model(cc.model.path or model_path, device)
        if cc.model.enable_gradient_checkpointing:
            cast(Any, self.model.decoder).gradient_checkpointing_enable()
        # torch.compile (inductor, CUDA only) of each decoder layer, as the actor's
        self.compiled = compiled.enabled(config.actor_rollout_ref.actor.use_torch_compile, device)
        if self.compiled:  # warmed up by the actor (Actor.warm_up_compiled)
            compiled.compile_layers(self.model)
        # the actor checked that the shared-prompt forward is exact for its model; the critic's decoder is
        # the same network when it uses the actor's model, and the checkpointed decoder has no KV cache
        self.shared_prompts = (
            shared_prompts and cc.model.path is None and not cc.model.enable_gradient_checkpointing
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cc.optim.lr,
            betas=cc.optim.betas,
            weight_decay=cc.optim.weight_decay,
            fused=device.type == "cuda",
        )
        self.step = 0

    # ------------------------------------------------------------ settings the actor's by default

    @property
    def ppo_epochs(self) -> int:
        return self.config.critic.ppo_epochs or self.config.actor_rollout_ref.actor.ppo_epochs

    @property
    def mini_batch_size(self) -> int:
        return (
            self.config.critic.ppo_mini_batch_size or self.config.actor_rollout_ref.actor.ppo_mini_batch_size
        )

    @property
    def token_budget(self) -> int:
        cc = self.config.critic
        return cc.ppo_max_token_len_per_gpu or self.config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu

    def warm_up_compiled(self, max_width: int) -> int:
        """Compile the value model's layers for every kind of micro-batch now (trainer/model/compiled.py):
        its token budget, samples up to ``max_width`` tokens; returns the passes run."""
        return compiled.warm_up(
            lambda mb, grad: [self._forward(mb)], self.model, self.device, self.token_budget, max_width
        )

    # ------------------------------------------------------------ forward passes

    def _split_micro_batches(self, batch: Batch) -> list[tuple[Batch, torch.Tensor]]:
        """The token-budget micro-batches this process runs, with their rows (trainer/distributed/data_parallel.py overrides)."""
        return micro_batches_with_rows(batch, self.token_budget, self.shared_prompts)

    def _gather_rows(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def _sync_gradients(self, on: bool) -> None:
        """Whether the next backward syncs gradients across processes (trainer/distributed/data_parallel.py; as the Actor's)."""

    def _reduce_gradients(self) -> None:
        """Sum the gradients over the processes before the step (trainer/distributed/data_parallel.py; as the Actor's)."""

    def _forward(self, mb: Batch) -> torch.Tensor:
        cuda = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
            inputs = compiled.model_inputs(mb) if self.compiled else mb  # compiled layers always get a mask
            return cast(torch.Tensor, self.model(inputs, self.shared_prompts))  # forward: FSDP's hooks run

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """V (B, R) for every response token of ``batch`` (0 off the response mask)."""
        was_training = self.model.training
        self.model.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)  # (B, R)
        for mb, rows in self._split_micro_batches(batch):
            v = self._forward(mb)  # (b, r)
            if len(rows):
                out[rows, : v.shape[1]] = v
        self.model.train(was_training)
        return self._gather_rows(out) * batch.response_mask

    # ------------------------------------------------------------ the update

    def update(
        self, batch: Batch, values: torch.Tensor, returns: torch.Tensor, train_mask: torch.Tensor
    ) -> dict[str, float]:
        """Fit the values to ``returns`` (B, R) on ``train_mask`` (B, R) tokens; ``values`` (B, R) are the
        old values the clipping is centred on. Returns the critic's metrics."""
        t0 = time.perf_counter()
        m = train_mask.bool()
        metrics: dict[str, float] = {
            "critic/values_mean": float(masked_mean(values, m)),
            "critic/returns_mean": float(masked_mean(returns, m)),
            "critic/vf_explained_var": explained_variance(values, returns, m),
        }
        batch.extras["old_values"], batch.extras["returns"] = values, returns
        train = replace(batch, response_mask=m.long())
        sums: dict[str, float] = {}
        steps = 0
        self.model.train()
        for _ in range(self.ppo_epochs):
            for mini in split_by_groups(train, self.mini_batch_size):
                for k, v in self._optimizer_step(mini).items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        metrics.update({k: v / max(steps, 1) for k, v in sums.items()})
        self.step += 1
        metrics["critic/optimizer_steps"] = float(steps)
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["timing/critic_update_s"] = time.perf_counter() - t0
        return metrics

    def _summed_over_ranks(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss metrics of the whole mini-batch from this process's share (trainer/distributed/data_parallel.py sums the
        ranks'); one process holds it all."""
        return totals

    def _optimizer_step(self, mini: Batch) -> dict[str, float]:
        cc = self.config.critic
        agg = cc.loss_agg_mode
        mask_all = mini.response_mask.bool()  # (b, R)
        denom = loss_denominator(mask_all, agg)
        if agg == "attempt-mean-token-mean":
            from trainer.algorithms import attempt_row_weights

            mini.extras["row_weights"] = attempt_row_weights(mask_all, mini.row_attempts())
        self.optimizer.zero_grad(set_to_none=True)
        if not bool(mask_all.any()):
            return {**dict.fromkeys(_LOSS_METRICS, 0.0), "critic/grad_norm": 0.0}
        # the metrics stay on the device until the step reads them: nothing in the loop waits for the GPU
        totals = {k: torch.zeros((), device=self.device) for k in _LOSS_METRICS}
        total_tokens = mask_all.sum().clamp(min=1)
        micro = self._split_micro_batches(mini)
        try:
            for i, (mb, _rows) in enumerate(micro):
                r = mb.response_length
                m = mb.response_mask.bool()
                vpreds = self._forward(mb)  # (b, r)
                out = value_loss(
                    vpreds,
                    mb.extras["old_values"][:, :r],
                    mb.extras["returns"][:, :r],
                    mb.response_mask,
                    cliprange_value=cc.cliprange_value,
                    loss_agg_mode=agg,
                    denominator=denom,
                    row_weights=mb.extras.get("row_weights"),
                )
                self._sync_gradients(i == len(micro) - 1)  # padded: the same count on every rank
                out.loss.backward()
                share = m.sum() / total_tokens
                totals["critic/vf_loss"] += out.loss.detach()
                totals["critic/vf_clipfrac"] += out.clip_frac * share
                totals["critic/vpred_mean"] += masked_mean(vpreds.detach(), m) * share
        finally:
            self._sync_gradients(True)  # also after an exception: the next backward syncs again
        totals = self._summed_over_ranks(totals)
        self._reduce_gradients()
        read, grad_norm = clipped_step(
            self.optimizer,
            self.model.parameters(),
            max_norm=cc.grad_clip,
            optim=cc.optim,
            step=self.step,
            totals=totals,
            role="critic",
        )
        return {**read, "critic/grad_norm": grad_norm}

    # ------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
