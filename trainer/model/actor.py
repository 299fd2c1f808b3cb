"""The policy (+ a frozen reference only when KL is used), its optimizer and one PPO/GRPO update.

One update on a Batch:
  1. old logprobs (trainer/model/old_logprobs.py): on-policy the loss's own forward's, detached; else
     recomputed, or the engine's own when close enough; the train/engine gap is reported in every case.
     Every log-prob (old, new, reference, and the entropy) is that of the policy that sampled: the
     logits of each token are divided by its call's recorded sampling temperature, as the engines do.
  2. rollout correction (trainer/algorithms/rollout_correction.py) against the engine's log-probs: truncated IS
     weights and rejection masks, on by default when sampling can be off-policy.
  3. reference logprobs when a KL term is configured; KL subtracted from rewards when
     ``algorithm.use_kl_in_reward``.
  4. advantages per call with each attempt voting once in its group (trainer/batch/advantages.py).
  5. ``ppo_epochs`` passes over mini-batches of ``ppo_mini_batch_size`` tasks' samples; each
     mini-batch is split into micro-batches by token budget and gradients are accumulated, then
     clipped and applied by AdamW.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainer.algorithms import (
    LossAggMode,
    PolicyLossOutput,
    agg_loss,
    attempt_row_weights,
    compute_policy_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    loss_denominator,
    masked_mean,
)
from trainer.algorithms.rollout_correction import rollout_correction
from trainer.batch import Batch
from trainer.batch.advantages import attempt_gae, batch_advantages, loss_mask
from trainer.batch.splits import micro_batches_with_rows, split_by_groups
from trainer.config import TrainerConfig
from trainer.model._lora import merged_lora_weights, wrap_lora
from trainer.model._read_back import clipped_step
from trainer.model.attention_mask import attention_mask_for
from trainer.model.compiled import compile_layers, enabled, model_inputs, warm_up
from trainer.model.critic import Critic
from trainer.model.hidden import HeadJob, head_shortcut_is_exact, response_logprobs, shared_prompt_is_exact
from trainer.model.old_logprobs import from_the_loss, old_logprobs
from trainer.model.policy_model import load_policy

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def resolve_device(name: str) -> torch.device:
    """agentloop.device.pick_device as a torch.device, without its CUDA check (the driver names the
    device of Ray workers that may run on another machine)."""
    from agentloop.device import pick_device

    return torch.device(pick_device(name, check=False))


class Actor:
    """Owns the trainable policy, the optional reference model and the optimizer."""

    # compiled (CUDA): run every kind of micro-batch once when built, so no update recompiles mid-run;
    # the sharded actor warms up later, once its layers are sharded (trainer/distributed/data_parallel.py)
    warm_up_on_init = True

    def __init__(self, config: TrainerConfig, model_path: str | Path, device: str = "auto") -> None:
        self.config = config
        self.device = resolve_device(device)
        torch.manual_seed(config.trainer.seed)
        self.model = load_policy(model_path, self.device)
        arr = config.actor_rollout_ref
        if arr.model.enable_gradient_checkpointing:
            cast("PreTrainedModel", self.model).gradient_checkpointing_enable()
        if arr.model.lora_rank > 0:
            self.model = wrap_lora(self.model, config)
        # torch.compile (inductor, CUDA only): each decoder layer and the LM-head statistics (head.py)
        self.compiled = enabled(arr.actor.use_torch_compile, self.device)
        self.fused_head = head_shortcut_is_exact(self.model, self.device)
        # each distinct prompt of a micro-batch runs once (a GRPO group's attempts share theirs)
        self.shared_prompts = (
            arr.actor.shared_prompt_forward
            and self.fused_head
            and not arr.model.enable_gradient_checkpointing  # HF turns the KV cache off under it
            # compiled layers recompile for each layer's cache state (dynamo's limit is 8): on an H100
            # the shared forward then ran at 0.78-0.88x the plain one (results/shared_prompt_gpu.json)
            and not self.compiled
            and shared_prompt_is_exact(self.model, self.device)
        )
        needs_ref = arr.actor.use_kl_loss or config.algorithm.use_kl_in_reward
        self.ref: nn.Module | None = None
        if needs_ref:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        optim = arr.actor.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused: one kernel for all params on CUDA
            params,
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.step = 0
        self.critic: Critic | None = None
        if config.uses_critic:  # colocated with the policy, on the same device
            self.critic = self._make_critic(model_path)
        if self.compiled:  # after the probes above, which run the layers in float32, outside autocast
            for model in (self.model, self.ref):
                if model is not None:
                    compile_layers(model)  # the same layer code: the two share their graphs
            if self.warm_up_on_init:  # every recompile now, none mid-run (trainer/model/compiled.py)
                self.warm_up_compiled()

    def warm_up_compiled(self) -> int:
        """Compile the layers for every kind of micro-batch this actor's updates bring (the token
        budget, the longest sample): the policy's passes, the reference model's and the critic's;
        returns the passes run."""
        cfg = self.config
        budget = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
        longest = cfg.data.row_tokens

        def policy(mb: Batch, grad: bool) -> list[torch.Tensor]:
            logprobs, entropy = self._forward(self.model, mb, grad)  # the update computes entropy
            return [logprobs] if entropy is None else [logprobs, entropy]

        passes = warm_up(policy, self.model, self.device, budget, longest)
        ref = self.ref
        if ref is not None:  # its frozen parameters (requires_grad off) are another guard
            passes += warm_up(
                lambda mb, grad: [self._forward(ref, mb, False)[0]],
                ref,
                self.device,
                budget,
                longest,
                grad=False,
            )
        if self.critic is not None and self.critic.compiled:
            passes += self.critic.warm_up_compiled(longest)
        return passes

    def _make_critic(self, model_path: str | Path) -> Critic:
        """The value model beside this policy (trainer/distributed/data_parallel.py makes a sharded one)."""
        return Critic(self.config, model_path, self.device, shared_prompts=self.shared_prompts)

    # ------------------------------------------------------------ forward passes

    def _forward(
        self, model: nn.Module, mb: Batch, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (b, R) of the response tokens and, if asked, their entropy (b, R), under each
        token's sampling temperature (logits / T; T = 0, greedy, takes the raw logits)."""
        p, r = mb.prompt_length, mb.response_length
        inputs = model_inputs(mb) if self.compiled else mb  # compiled layers always get a mask
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            fused = response_logprobs(model, self._head_job(mb, inputs)) if self.fused_head else None
            if fused is not None:
                logprobs, ent = fused
                return logprobs, (ent if entropy else None)
            out = model(
                input_ids=inputs.input_ids,
                attention_mask=attention_mask_for(model, inputs.attention_mask, inputs.fully_real()),
                position_ids=inputs.position_ids,
                use_cache=False,
            )
            logits = out.logits[:, p - 1 : p + r - 1]  # (b, R, V): position t scores token t+1
        logits = logits.float() / mb.logit_temperatures()[:, :r, None]  # (b, R, V): the policy's logits
        logprobs = logprobs_from_logits(logits, mb.responses)  # (b, R) float32
        return logprobs, (entropy_from_logits(logits) if entropy else None)

    def _head_job(self, mb: Batch, inputs: Batch) -> HeadJob:
        """The fused head's work for micro-batch ``mb``, whose decoder input is ``inputs``."""
        return HeadJob(
            inputs,
            mb.responses,
            mb.logit_temperatures()[:, : mb.response_length, None],  # (b, R, 1)
            shared_prompts=self.shared_prompts,
            compute_dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32,
            compile=self.compiled,
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, model: nn.Module | None = None) -> torch.Tensor:
        """Logprobs (B, R) of every response token under ``model`` (the policy by default).

        The one log-prob path of the single and the data-parallel actor: this process runs the
        micro-batches ``_split_micro_batches`` gives it, and ``_gather_rows`` joins the processes' rows
        (trainer/distributed/data_parallel.py: each rank computes its share and the ranks' (B, R) tensors are summed)."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)  # (B, R)
        for mb, rows in self._split_micro_batches(batch):
            lp, _ = self._forward(model, mb, entropy=False)  # (b, r)
            if len(
                rows
            ):  # a padding micro-batch (trainer/distributed/data_parallel.py) holds no row of batch
                out[rows, : lp.shape[1]] = lp
        model.train(was_training)
        return self._gather_rows(out) * batch.response_mask

    def _split_micro_batches(self, batch: Batch) -> list[tuple[Batch, torch.Tensor]]:
        """The token-budget micro-batches this process runs, each with the row indices (into ``batch``)
        it holds; for log-probs and for the update (trainer/distributed/data_parallel.py: this rank's share, padded)."""
        budget = self.config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
        return micro_batches_with_rows(batch, budget, self.shared_prompts)

    def _gather_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The (B, R) log-probs of every row, from ``out`` holding the rows this process computed."""
        return out

    def _sync_gradients(self, on: bool) -> None:
        """Whether the next backward syncs its gradients across processes: trainer/distributed/data_parallel.py skips the sync
        on all but a mini-batch's last micro-batch (fsdp_config.grad_sync_per_micro_batch=false); one
        process has nothing to sync."""

    # ------------------------------------------------------------ the update

    def update(self, batch: Batch) -> dict[str, float]:
        """One PPO/GRPO update on ``batch``; returns its metrics."""
        cfg, actor = self.config, self.config.actor_rollout_ref.actor
        t0 = time.perf_counter()
        batch = batch.to(self.device)
        metrics: dict[str, float] = {}
        on_device: dict[str, torch.Tensor] = {}  # metrics read back after the update, not before it
        batch = self._loss_batch(batch, metrics, on_device)

        sums: dict[str, float] = {}
        n_steps = 0
        self.model.train()
        warming_up = self.critic is not None and self.step < cfg.trainer.critic_warmup
        metrics["actor/critic_warmup"] = float(warming_up)  # the policy waits while the critic learns
        for _ in range(0 if warming_up else actor.ppo_epochs):
            for mini in split_by_groups(batch, actor.ppo_mini_batch_size):
                step_metrics = self._optimizer_step(mini)
                for k, v in step_metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_steps += 1
        metrics.update({k: v / max(n_steps, 1) for k, v in sums.items()})
        if on_device:
            read = torch.stack([v.double() for v in on_device.values()]).tolist()
            metrics.update(zip(on_device, read, strict=True))
        self.step += 1
        tokens = sum(batch.rows_on_host().sequence_tokens())
        elapsed = time.perf_counter() - t0
        metrics.update(
            {
                "actor/optimizer_steps": float(n_steps),
                "actor/lr": self.optimizer.param_groups[0]["lr"],
                "timing/update_s": elapsed,
                "perf/update_tokens_per_s": tokens * actor.ppo_epochs / max(elapsed, 1e-9),
            }
        )
        return metrics

    def _loss_batch(
        self, batch: Batch, metrics: dict[str, float], on_device: dict[str, torch.Tensor]
    ) -> Batch:
        """The update's first step: ``batch`` with its old log-probs, advantages (and the critic fitted)
        in ``extras``, its response mask cut to the tokens the loss trains on."""
        cfg = self.config
        mask = batch.response_mask  # (B, R)
        on_policy = from_the_loss(cfg, batch, has_ref=self.ref is not None)
        old = None if on_policy else self._old_logprobs(batch, metrics)  # (B, R)
        metrics["actor/old_logprobs_from_the_loss"] = float(old is None)
        if old is not None:
            batch.extras["old_logprobs"] = old
        keep = self._corrected_loss_mask(batch, old, metrics)  # (B, R) bool
        kl = self._kl_in_reward(batch, old, on_device)  # (B, R) or None
        if self.critic is not None:  # PPO: values, GAE over each attempt, the critic fitted to the returns
            values = self.critic.values(batch)  # (B, R)
            adv, returns = attempt_gae(batch, values, cfg, kl)  # (B, R) each
            metrics.update(self.critic.update(batch, values, returns, loss_mask(batch, cfg)))
        else:
            adv = batch_advantages(batch, cfg, kl)  # (B, R)
        # rewards are bounded (MAX_ABS_REWARD) and build_batch drops non-finite ones; an inf or NaN that
        # still comes out of an estimator trains nothing (0) and is counted, with no host sync here
        finite = torch.isfinite(adv)  # (B, R)
        on_device["actor/advantage_nonfinite"] = (~finite & mask.bool()).sum()
        adv = torch.where(finite, adv, torch.zeros_like(adv))
        batch.extras["advantages"] = adv
        on_device["actor/advantage_abs_mean"] = masked_mean(adv.abs(), mask.bool())
        if batch.truncated is not None:
            on_device["actor/truncated_samples"] = batch.truncated.sum()
        on_device["actor/loss_tokens_masked"] = (mask.bool() & ~keep).sum()
        return replace(batch, response_mask=keep.long())  # the loss trains on these tokens only

    def _corrected_loss_mask(
        self, batch: Batch, old: torch.Tensor | None, metrics: dict[str, float]
    ) -> torch.Tensor:
        """The tokens the loss trains on (overlong-filtered samples out), less those rollout correction
        rejects; its importance weights go into ``batch.extras``."""
        cfg = self.config
        keep = loss_mask(batch, cfg)  # (B, R) bool: overlong-filtered samples out of the loss
        is_level = cfg.rollout_is_level()
        corr_cfg = cfg.algorithm.rollout_correction
        if batch.engine_logprobs is not None and (is_level is not None or corr_cfg.rollout_rs is not None):
            assert old is not None  # from_the_loss: not with rollout correction
            corr = rollout_correction(old, batch.engine_logprobs, batch.response_mask, corr_cfg, is_level)
            metrics.update(corr.metrics)
            keep = keep & corr.keep
            if corr.weights is not None:
                batch.extras["rollout_is_weights"] = corr.weights
        return keep

    def _kl_in_reward(
        self, batch: Batch, old: torch.Tensor | None, on_device: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The reference's log-probs into ``batch.extras`` (when there is a reference), and the KL penalty
        the rewards pay when ``algorithm.use_kl_in_reward`` (B, R), else None."""
        cfg = self.config
        if self.ref is None:
            return None
        mask = batch.response_mask  # (B, R)
        ref = self.compute_logprobs(batch, self.ref)
        batch.extras["ref_logprobs"] = ref
        if not cfg.algorithm.use_kl_in_reward:
            return None
        assert old is not None  # from_the_loss: not with the KL in the reward
        kl = kl_penalty(old, ref, cfg.algorithm.kl_penalty).masked_fill(~mask.bool(), 0.0)  # (B, R)
        on_device["actor/kl_in_reward"] = masked_mean(kl, mask.bool(), dim=-1).mean()
        return kl

    def _old_logprobs(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """The update's old log-probs when not on-policy (trainer/model/old_logprobs.py)."""
        return old_logprobs(self.config, batch, self.compute_logprobs, metrics)

    def _optimizer_step(self, mini: Batch) -> dict[str, float]:
        actor = self.config.actor_rollout_ref.actor
        mask_all = mini.response_mask.bool()  # (b, R)
        agg = actor.loss_agg_mode
        pg_agg = "seq-mean-token-mean" if actor.policy_loss == "gspo" else agg  # gspo fixes its own
        # one denominator for the whole mini-batch so accumulated micro-batches equal one big batch
        denom, pg_denom = loss_denominator(mask_all, agg), loss_denominator(mask_all, pg_agg)
        if agg == "attempt-mean-token-mean":  # per-row weights over the whole mini-batch's attempts
            mini.extras["row_weights"] = attempt_row_weights(mask_all, mini.row_attempts())
        self.optimizer.zero_grad(set_to_none=True)
        active, idle = _rows_with_signal(mini, actor.entropy_coeff == 0 and not actor.use_kl_loss)
        # the rows left out still count in actor/entropy, the whole mini-batch's (verl's): a forward
        # without autograd, against the mini-batch's denominator
        idle_entropy = None if idle is None else self._entropy_without_grad(idle, agg, denom)
        if len(active) == 0:  # every advantage is 0: the gradient is exactly 0, so no step
            return self._metrics_without_a_step(idle_entropy)
        totals, gap_max = self._loss_totals(mini, idle_entropy)
        active_tokens = active.response_mask.sum().clamp(min=1)  # the rows the metrics average over
        micro = self._split_micro_batches(active)
        try:
            for i, (mb, _rows) in enumerate(micro):
                m = mb.response_mask.bool()  # (b, r)
                r = mb.response_length
                logprobs, ent = self._forward(self.model, mb, entropy=True)
                recorded = mb.extras.get("old_logprobs")  # None: on-policy, the policy has not stepped
                old = logprobs.detach() if recorded is None else recorded[:, :r]
                pl = self._policy_loss(mb, logprobs, old, agg)
                share = m.sum() / active_tokens  # this micro-batch's share of the active tokens
                # re-aggregate the policy loss against the mini-batch denominator
                policy_loss = pl.loss * loss_denominator(m, pg_agg) / pg_denom
                row_weights = mb.extras.get("row_weights")
                entropy = agg_loss(ent, mb.response_mask, agg, denominator=denom, row_weights=row_weights)  # type: ignore[arg-type]
                loss = policy_loss - actor.entropy_coeff * entropy
                if actor.use_kl_loss:
                    kl = self._kl_loss(mb, logprobs, agg, denom)
                    loss = loss + actor.kl_loss_coef * kl
                    totals["actor/kl_loss"] += kl.detach()
                self._sync_gradients(i == len(micro) - 1)  # padded: the same count on every rank
                loss.backward()
                totals["actor/pg_loss"] += policy_loss.detach()
                totals["actor/entropy"] += entropy.detach()
                totals["actor/clip_frac"] += pl.clip_frac * share
                totals["actor/approx_kl"] += pl.approx_kl * share
                if gap_max is not None:
                    assert mb.engine_logprobs is not None
                    gap = (old - mb.engine_logprobs[:, :r]).abs().masked_fill(~m, 0.0)  # (b, r)
                    totals["actor/engine_logprob_gap_mean"] += gap.sum() / active_tokens
                    gap_max = torch.maximum(gap_max, gap.max())
        finally:
            self._sync_gradients(True)  # also after an exception: the next backward syncs again
        totals = self._summed_over_ranks(totals)
        if gap_max is not None:
            totals["actor/engine_logprob_gap_max"] = self._max_over_ranks(gap_max)
        metrics = self._apply_gradients(totals)
        metrics["actor/active_samples"] = float(len(active))
        return metrics

    def _metrics_without_a_step(self, idle_entropy: torch.Tensor | None) -> dict[str, float]:
        """A mini-batch's metrics when no row has a signal: the loss terms 0, the entropy of its rows."""
        zeros = dict.fromkeys(self._loss_metric_names(), 0.0)
        if idle_entropy is not None:  # note: a CPU-GPU sync (no step follows to wait for)
            zeros["actor/entropy"] = float(self._summed_over_ranks({"e": idle_entropy})["e"])
        return {**zeros, "actor/active_samples": 0.0, "actor/grad_norm": 0.0}

    def _loss_totals(
        self, mini: Batch, idle_entropy: torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The step's loss metrics at 0 (the entropy of the rows left out already in), and the running max
        of the train/engine gap when the loss's forward gives the old log-probs (else None)."""
        # the metrics stay on the device until the step reads them: nothing in the loop waits for the GPU
        totals = {k: torch.zeros((), device=self.device) for k in self._loss_metric_names()}
        if idle_entropy is not None:
            totals["actor/entropy"] = idle_entropy
        # on-policy the loss's forward gives the old log-probs, and the train/engine gap over its tokens
        gap_max = None
        if "old_logprobs" not in mini.extras and mini.engine_logprobs is not None:
            totals["actor/engine_logprob_gap_mean"] = torch.zeros((), device=self.device)
            gap_max = torch.zeros((), device=self.device)
        return totals, gap_max

    def _policy_loss(
        self, mb: Batch, logprobs: torch.Tensor, old: torch.Tensor, agg: LossAggMode
    ) -> PolicyLossOutput:
        """The configured policy loss of micro-batch ``mb`` (log-probs (b, r)), aggregated by ``agg``."""
        actor = self.config.actor_rollout_ref.actor
        r = mb.response_length
        is_weights = mb.extras.get("rollout_is_weights")
        return compute_policy_loss(
            actor.policy_loss,
            logprobs,
            old,
            mb.extras["advantages"][:, :r],
            mb.response_mask,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
            loss_agg_mode=agg,
            rollout_is_weights=None if is_weights is None else is_weights[:, :r],
            row_weights=mb.extras.get("row_weights"),
        )

    def _kl_loss(
        self, mb: Batch, logprobs: torch.Tensor, agg: LossAggMode, denominator: torch.Tensor
    ) -> torch.Tensor:
        """The KL loss of micro-batch ``mb`` against the reference, against the mini-batch's denominator."""
        actor = self.config.actor_rollout_ref.actor
        ref = mb.extras["ref_logprobs"][:, : mb.response_length]
        return agg_loss(
            kl_penalty(logprobs, ref, actor.kl_loss_type),
            mb.response_mask,
            agg,
            denominator=denominator,
            row_weights=mb.extras.get("row_weights"),
        )

    @torch.no_grad()
    def _entropy_without_grad(self, rows: Batch, agg: str, denominator: torch.Tensor) -> torch.Tensor:
        """The entropy term of ``rows`` (a device scalar): ``agg_loss`` of their token entropies against
        the whole mini-batch's ``denominator``, as the loss's micro-batches add theirs, so the two sum to
        the mini-batch's entropy. For the rows the loss leaves out (``_rows_with_signal``): their
        forward runs without autograd, as the log-prob passes do (eval mode, this process's micro-batches,
        padded alike on every rank): about a third of the cost of the forward and backward it skips."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        try:
            for mb, _rows in self._split_micro_batches(rows):
                _, ent = self._forward(self.model, mb, entropy=True)  # (b, r)
                assert ent is not None
                row_weights = mb.extras.get("row_weights")
                total += agg_loss(
                    ent, mb.response_mask, agg, denominator=denominator, row_weights=row_weights
                )
        finally:
            self.model.train(was_training)
        return total

    def _summed_over_ranks(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss metrics of the whole mini-batch from this process's share (trainer/distributed/data_parallel.py sums the
        ranks'); one process holds it all."""
        return totals

    def _max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """A device scalar's maximum over the processes (trainer/distributed/data_parallel.py); one process holds it all."""
        return value

    def _reduce_gradients(self) -> None:
        """Sum the accumulated gradients over the processes before the step, where no FSDP unit did
        (trainer/distributed/data_parallel.py's whole-model replicas); one process holds them all."""

    def _loss_metric_names(self) -> list[str]:
        names = ["actor/pg_loss", "actor/entropy", "actor/clip_frac", "actor/approx_kl"]
        return [*names, "actor/kl_loss"] if self.config.actor_rollout_ref.actor.use_kl_loss else names

    def _apply_gradients(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """Clip the accumulated gradients to ``actor.grad_clip`` and take the optimizer step (skipped
        when the norm is not finite). Returns ``totals`` read back to the host, in the step's one CPU-GPU
        sync, with ``actor/grad_norm``: the norm before clipping."""
        actor = self.config.actor_rollout_ref.actor
        self._reduce_gradients()
        read, grad_norm = clipped_step(
            self.optimizer,
            [p for p in self.model.parameters() if p.requires_grad],
            max_norm=actor.grad_clip,
            optim=actor.optim,
            step=self.step,
            totals=totals,
            role="actor",
        )
        return {**read, "actor/grad_norm": grad_norm}

    # ------------------------------------------------------------ weights and checkpoints

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the base model's names (LoRA merged), detached, on CPU."""
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            return merged_lora_weights(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def state(self) -> dict[str, Any]:
        """Model (with LoRA: the frozen base under peft's names and the adapter), optimizer and step."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "lora_rank": self.config.actor_rollout_ref.model.lora_rank,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        rank = self.config.actor_rollout_ref.model.lora_rank
        saved = int(state.get("lora_rank", 0))  # checkpoints from before LoRA was recorded had none
        if saved != rank:
            raise ValueError(
                f"the checkpoint was written with actor_rollout_ref.model.lora_rank={saved}, this run has "
                f"{rank}; resume with the same lora_rank, or start afresh with trainer.resume=disable"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _rows_with_signal(mini: Batch, zero_adv_is_zero_grad: bool) -> tuple[Batch, Batch | None]:
    """``mini`` split into the samples the loss trains on and those it leaves out (None: none), which are
    the samples whose advantages are all 0 when those add nothing to the gradient.

    With no entropy bonus and no KL loss a sample's loss is proportional to its advantage, so dropping
    it (while the loss keeps the whole mini-batch's denominator) leaves the gradient unchanged; a GRPO
    group whose samples all scored the same costs no backward. Its tokens still count in the logged
    entropy, measured by a forward without autograd (``Actor._entropy_without_grad``).
    """
    if not zero_adv_is_zero_grad:
        return mini, None
    adv = mini.extras["advantages"] * mini.response_mask  # (b, R)
    keep = (adv != 0).any(-1).tolist()  # (b,)  note: the CPU-GPU sync of the selection
    if all(keep):
        return mini, None
    kept = [i for i, k in enumerate(keep) if k]
    idle = mini if not kept else mini.select([i for i, k in enumerate(keep) if not k])
    return mini.select(kept), idle
