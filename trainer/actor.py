"""The policy (+ a frozen reference only when KL is used), its optimizer and one PPO/GRPO update.

One update on a Batch:
  1. old logprobs: recomputed with the current weights (default), or the engine's own logprobs
     (``actor.use_engine_logprobs``); the train/engine gap is reported either way.
  2. reference logprobs when a KL term is configured; KL subtracted from rewards when
     ``algorithm.use_kl_in_reward``.
  3. advantages by the registered estimator, grouped by rollout input.
  4. ``ppo_epochs`` passes over mini-batches of ``ppo_mini_batch_size * rollout.n`` samples; each
     mini-batch is split into micro-batches by token budget and gradients are accumulated, then
     clipped and applied by AdamW.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from trainer.algorithms import (
    agg_loss,
    apply_kl_in_reward,
    compute_advantage,
    compute_policy_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    scores_to_token_rewards,
)
from trainer.batch import Batch, split_by_token_budget, split_mini_batches
from trainer.config import TrainerConfig

log = structlog.get_logger("agentloop.trainer.actor")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_policy(path: str | Path, device: torch.device) -> nn.Module:
    """A causal LM from a Hugging Face folder with fp32 master weights (bf16 compute comes from autocast:
    AdamW steps of ~1e-6 would vanish in bf16 weights)."""
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; give a Hugging Face model folder")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


class Actor:
    """Owns the trainable policy, the optional reference model and the optimizer."""

    def __init__(self, config: TrainerConfig, model_path: str | Path, device: str = "auto") -> None:
        self.config = config
        self.device = resolve_device(device)
        torch.manual_seed(config.trainer.seed)
        self.model = load_policy(model_path, self.device)
        arr = config.actor_rollout_ref
        if arr.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if arr.model.lora_rank > 0:
            self.model = _wrap_lora(self.model, config)
        needs_ref = arr.actor.use_kl_loss or config.algorithm.use_kl_in_reward
        self.ref: nn.Module | None = None
        if needs_ref:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        optim = arr.actor.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
        )
        self.step = 0

    # ------------------------------------------------------------ forward passes

    def _forward(
        self, model: nn.Module, mb: Batch, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (b, R) of the response tokens and, if asked, their entropy (b, R)."""
        p, r = mb.prompt_length, mb.response_length
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = _response_logits(model, mb, p, r)  # (b, R, V): position t scores token t+1
        logprobs = logprobs_from_logits(logits, mb.responses)  # (b, R) float32
        ent = entropy_from_logits(logits) if entropy else None
        return logprobs, ent

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, model: nn.Module | None = None) -> torch.Tensor:
        """Logprobs (B, R) of every response token under ``model`` (the policy by default)."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)  # (B, R)
        budget = self.config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
        for mb, rows in _micro_batches(batch, budget):
            lp, _ = self._forward(model, mb, entropy=False)  # (b, r)
            out[rows, : lp.shape[1]] = lp
        model.train(was_training)
        return out * batch.response_mask

    # ------------------------------------------------------------ the update

    def update(self, batch: Batch) -> dict[str, float]:
        """One PPO/GRPO update on ``batch``; returns its metrics."""
        cfg, arr = self.config, self.config.actor_rollout_ref
        actor = arr.actor
        t0 = time.perf_counter()
        batch = batch.to(self.device)
        mask = batch.response_mask  # (B, R)
        metrics: dict[str, float] = {}

        if actor.use_engine_logprobs and batch.engine_logprobs is not None:
            old = batch.engine_logprobs  # skips a forward pass over the whole batch
        else:
            old = self.compute_logprobs(batch)  # (B, R)
        if batch.engine_logprobs is not None and old is not batch.engine_logprobs:
            gap = (old - batch.engine_logprobs).abs()  # (B, R)
            metrics["actor/engine_logprob_gap_mean"] = float(masked_mean(gap, mask.bool()))
            metrics["actor/engine_logprob_gap_max"] = float((gap * mask).max())
        batch.extras["old_logprobs"] = old

        token_rewards = scores_to_token_rewards(batch.rewards, mask)  # (B, R)
        if self.ref is not None:
            ref = self.compute_logprobs(batch, self.ref)
            batch.extras["ref_logprobs"] = ref
            if cfg.algorithm.use_kl_in_reward:
                kl = kl_penalty(old, ref, cfg.algorithm.kl_penalty)  # (B, R)
                token_rewards, kl_mean = apply_kl_in_reward(
                    token_rewards, kl, cfg.algorithm.kl_ctrl.kl_coef, mask
                )
                metrics["actor/kl_in_reward"] = float(kl_mean)
        adv = compute_advantage(
            cfg.algorithm.adv_estimator,
            token_rewards,
            mask,
            index=batch.group_ids,
            norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
        )
        batch.extras["advantages"] = adv.advantages
        metrics["actor/advantage_abs_mean"] = float(masked_mean(adv.advantages.abs(), mask.bool()))

        mini_size = actor.ppo_mini_batch_size * arr.rollout.n
        sums: dict[str, float] = {}
        n_steps = 0
        self.model.train()
        for _ in range(actor.ppo_epochs):
            for mini in split_mini_batches(batch, mini_size):
                step_metrics = self._optimizer_step(mini)
                for k, v in step_metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_steps += 1
        metrics.update({k: v / max(n_steps, 1) for k, v in sums.items()})
        self.step += 1
        tokens = int(batch.attention_mask.sum())
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

    def _optimizer_step(self, mini: Batch) -> dict[str, float]:
        actor = self.config.actor_rollout_ref.actor
        mask_all = mini.response_mask.bool()  # (b, R)
        agg = actor.loss_agg_mode
        pg_agg = "seq-mean-token-mean" if actor.policy_loss == "gspo" else agg  # gspo fixes its own
        # one denominator for the whole mini-batch so accumulated micro-batches equal one big batch
        denom, pg_denom = _local_count(mask_all, agg), _local_count(mask_all, pg_agg)
        self.optimizer.zero_grad(set_to_none=True)
        totals = {"actor/pg_loss": 0.0, "actor/entropy": 0.0, "actor/clip_frac": 0.0, "actor/approx_kl": 0.0}
        if actor.use_kl_loss:
            totals["actor/kl_loss"] = 0.0
        active = _rows_with_signal(mini, actor.entropy_coeff == 0 and not actor.use_kl_loss)
        totals["actor/active_samples"] = float(len(active))
        if len(active) == 0:  # every advantage is 0: the gradient is exactly 0, so no step (and no forward)
            totals["actor/grad_norm"] = 0.0
            return totals
        for mb, _rows in self._train_micro_batches(active):
            m = mb.response_mask.bool()  # (b, r)
            r = mb.response_length
            logprobs, ent = self._forward(self.model, mb, entropy=True)
            old = mb.extras["old_logprobs"][:, :r]
            adv = mb.extras["advantages"][:, :r]
            pl = compute_policy_loss(
                actor.policy_loss,
                logprobs,
                old,
                adv,
                mb.response_mask,
                clip_ratio_low=actor.clip_ratio_low,
                clip_ratio_high=actor.clip_ratio_high,
                clip_ratio_c=actor.clip_ratio_c,
                loss_agg_mode=agg,
            )
            share = float(m.sum()) / max(float(mask_all.sum()), 1.0)  # this micro-batch's share of tokens
            # re-aggregate the policy loss against the mini-batch denominator
            policy_loss = pl.loss * _local_count(m, pg_agg) / pg_denom
            entropy = agg_loss(ent, mb.response_mask, agg, denominator=denom)  # type: ignore[arg-type]
            loss = policy_loss - actor.entropy_coeff * entropy
            if actor.use_kl_loss:
                ref = mb.extras["ref_logprobs"][:, :r]
                kl = agg_loss(
                    kl_penalty(logprobs, ref, actor.kl_loss_type), mb.response_mask, agg, denominator=denom
                )
                loss = loss + actor.kl_loss_coef * kl
                totals["actor/kl_loss"] += float(kl)
            loss.backward()
            totals["actor/pg_loss"] += float(policy_loss.detach())
            totals["actor/entropy"] += float(entropy.detach())
            totals["actor/clip_frac"] += float(pl.clip_frac) * share
            totals["actor/approx_kl"] += float(pl.approx_kl) * share
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, actor.grad_clip)  # note: CPU-GPU sync
        if math.isfinite(float(grad_norm)):
            self._apply_warmup()
            self.optimizer.step()
        else:
            log.warning("actor.skip_step_nonfinite_grad", grad_norm=float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        totals["actor/grad_norm"] = float(grad_norm)
        return totals

    def _train_micro_batches(self, mini: Batch) -> list[tuple[Batch, torch.Tensor]]:
        """The micro-batches this process trains on (trainer/dp.py: this rank's share, padded)."""
        return _micro_batches(mini, self.config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu)

    def _apply_warmup(self) -> None:
        optim = self.config.actor_rollout_ref.actor.optim
        if optim.lr_warmup_steps > 0:
            scale = min(1.0, (self.step + 1) / optim.lr_warmup_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = optim.lr * scale

    # ------------------------------------------------------------ weights and checkpoints

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the base model's names (LoRA merged), detached, on CPU."""
        model = self.model
        if hasattr(model, "merge_and_unload"):  # peft: a merged copy, the adapter stays trainable
            model = copy.deepcopy(model).merge_and_unload()
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _response_logits(model: nn.Module, mb: Batch, p: int, r: int) -> torch.Tensor:
    """Logits (b, R, V) at the positions that score the response tokens.

    The LM head runs on those R positions only, not on the prompt: with a 49k-151k vocabulary the head
    is a fifth or more of the model's matmul work, and prompts are often longer than responses.
    Models that post-process logits (soft-capping) take the plain full forward instead.
    """
    head = model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if head is None or decoder is None or getattr(model.config, "final_logit_softcapping", None):
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
        return out.logits[:, p - 1 : p + r - 1]
    hidden = decoder(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
    ).last_hidden_state  # (b, P+R, d)
    return head(hidden[:, p - 1 : p + r - 1])  # (b, R, V)


def _rows_with_signal(mini: Batch, zero_adv_is_zero_grad: bool) -> Batch:
    """``mini`` without the samples whose advantages are all 0, when those add nothing to the gradient.

    With no entropy bonus and no KL loss a sample's loss is proportional to its advantage, so dropping
    it (while the loss keeps the whole mini-batch's denominator) leaves the gradient unchanged; a GRPO
    group whose samples all scored the same costs no forward/backward.
    """
    if not zero_adv_is_zero_grad:
        return mini
    adv = mini.extras["advantages"] * mini.response_mask  # (b, R)
    keep = (adv != 0).any(-1)  # (b,)  note: CPU-GPU sync below
    if bool(keep.all()):
        return mini
    return mini.select(keep.nonzero().flatten())


def _local_count(mask: torch.Tensor, agg: str) -> float:
    """What agg_loss divided this micro-batch's loss by (tokens or sequences with a token)."""
    if agg == "token-mean":
        return max(float(mask.sum()), 1.0)
    return max(float((mask.sum(-1) > 0).sum()), 1.0)


def _micro_batches(batch: Batch, budget: int) -> list[tuple[Batch, torch.Tensor]]:
    """Token-budget micro-batches of ``batch`` with the row indices (into batch) each one holds."""
    batch.extras["row"] = torch.arange(len(batch), device=batch.input_ids.device)  # (B,)
    return [(mb, mb.extras["row"]) for mb in split_by_token_budget(batch, budget, padded=True)]


def _wrap_lora(model: nn.Module, config: TrainerConfig) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("actor_rollout_ref.model.lora_rank > 0 needs `pip install peft`") from exc
    m = config.actor_rollout_ref.model
    lora = LoraConfig(
        r=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=m.target_modules, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora)
