"""A training model of the Tinker API: the base causal LM with LoRA adapters, and Adam over them.

Tinker's training client accumulates gradients over ``forward_backward`` calls and applies them at
``optim_step``; ``forward`` is ``forward_backward`` without the backward. Every method here blocks
(torch on the CPU or GPU): the service runs them in a worker thread, one at a time per model, in
the order the client sent them.

The model, LoRA, log-prob and checkpoint code is the trainer's (``trainer.model.policy_model.load_policy``,
``trainer.model._lora.wrap_lora`` / ``merged_lora_weights``, ``trainer.algorithms._logprobs.logprobs_from_logits``,
``trainer.run_folder.checkpoint.save_policy`` / ``load_policy_state``). ``agentloop/`` never imports ``trainer/``
(DESIGN.md), so the CLI hands those functions in as ``TrainerParts``
(``agentloop.commands.tinker.trainer_parts``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from agentloop.tinker.losses import compute_loss
from agentloop.tinker.wire import AdamParams, Datum, ForwardBackward, LoraConfig, WireError

__all__ = ["LORA_ALPHA", "MICROBATCH_TOKENS", "TrainerParts", "TrainingModel", "lora_targets"]

LORA_ALPHA = 32  # fixed alpha (scale alpha / rank), so a rank change does not retune the learning rate
# padded tokens per forward: ~100 MB of SmolLM2 logits (B, T, 49152); on one CPU thread 36 RL sequences took
# 27 s in microbatches of 512 tokens and 38 s in one of 2048
MICROBATCH_TOKENS = 512
META_FILE = "tinker.json"


@dataclass(frozen=True)
class TrainerParts:
    """The trainer's functions a training model runs on (module docstring)."""

    load_policy: Callable[[str | Path, torch.device], nn.Module]
    wrap_lora: Callable[[nn.Module, int, int, list[str]], nn.Module]  # (model, rank, alpha, targets)
    merged_weights: Callable[[nn.Module], dict[str, torch.Tensor]]
    token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (B, T, V), (B, T) -> (B, T)
    save_state: Callable[[nn.Module, torch.optim.Optimizer, int, int, Path], None]
    load_state: Callable[[nn.Module, torch.optim.Optimizer, int, Path, torch.device], Any]


def lora_targets(model: nn.Module, lora: LoraConfig) -> list[str]:
    """The names of the linear layers that get adapters: attention, MLP, and the output projection
    (unembed) unless it is tied to the input embeddings (one weight for two roles: not adapted)."""
    get_out = getattr(model, "get_output_embeddings", None)
    out_emb = get_out() if callable(get_out) else None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    names: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if module is out_emb:
            if lora.train_unembed and not tied:
                names.add(leaf)
        elif any(k in name for k in ("attn", "attention")):
            if lora.train_attn:
                names.add(leaf)
        elif any(k in name for k in ("mlp", "feed_forward", "expert")) and lora.train_mlp:
            names.add(leaf)
    return sorted(names)


class TrainingModel:
    """One LoRA training model (module docstring). ``step`` counts optimizer steps."""

    def __init__(
        self,
        model_id: str,
        base_model: str,
        model_path: Path,
        lora: LoraConfig,
        parts: TrainerParts,
        device: torch.device,
    ) -> None:
        self.model_id, self.base_model, self.model_path = model_id, base_model, model_path
        self.lora, self.parts, self.device = lora, parts, device
        base = parts.load_policy(model_path, device)
        targets = lora_targets(base, lora)
        if not targets:
            raise WireError(
                "lora_config selects no layer of this model: set train_attn or train_mlp "
                "(train_unembed alone does nothing on a model whose output projection is tied)"
            )
        if lora.seed is not None:
            torch.manual_seed(lora.seed)
        self.model = parts.wrap_lora(base, lora.rank, LORA_ALPHA, targets)
        self.model.eval()  # no dropout: forward_backward's logprobs are the sampler's for the same weights
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        self.step = 0
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]

    def _new_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    # ------------------------------------------------------------------ training

    def forward_backward(self, fb: ForwardBackward) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum its target tokens' logprobs and per-token loss; metrics ``loss:sum``. Gradients
        add up in the adapters until ``optim_step`` (not with ``fb.forward_only``)."""
        outputs: list[dict[str, np.ndarray]] = [{} for _ in fb.data]
        total = 0.0
        for batch in _microbatches(fb.data, MICROBATCH_TOKENS):
            with torch.set_grad_enabled(not fb.forward_only):
                lps = self._target_logprobs([fb.data[i] for i in batch])
                losses = []
                for i, lp in zip(batch, lps, strict=True):
                    d = fb.data[i]
                    inputs = {k: v.to(self.device) for k, v in d.inputs.items()}
                    per_token = compute_loss(fb.loss_fn, lp, inputs, fb.config)  # (N,)
                    losses.append(per_token.sum())
                    outputs[i] = {
                        "logprobs": lp.detach().float().cpu().numpy(),
                        "elementwise_loss": per_token.detach().float().cpu().numpy(),
                    }
                loss = torch.stack(losses).sum()
                if not fb.forward_only:
                    loss.backward()
            total += float(loss.detach())
        return outputs, {"loss:sum": total}

    def _target_logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """log p(target_tokens[t] | tokens[:t+1]) of each datum, (N_i,), through the model (right padding)."""
        n = max(len(d.tokens) for d in data)
        ids = torch.zeros((len(data), n), dtype=torch.long)
        targets = torch.zeros((len(data), n), dtype=torch.long)
        mask = torch.zeros((len(data), n), dtype=torch.long)
        for row, d in enumerate(data):
            k = len(d.tokens)
            ids[row, :k] = torch.tensor(d.tokens)
            targets[row, :k] = d.target_tokens
            mask[row, :k] = 1
        ids, targets, mask = ids.to(self.device), targets.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        lp = self.parts.token_logprobs(logits, targets)  # (B, T)
        return [lp[row, : len(d.tokens)] for row, d in enumerate(data)]

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, then zero them."""
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            if grads
            else 0.0
        )
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(self.params, adam.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"optim/grad_norm": norm, "optim/step": float(self.step)}

    # ------------------------------------------------------------------ state

    def save(self, folder: Path) -> None:
        """The trainer's checkpoint files (weights + Adam state) and what the model was made from."""
        folder.mkdir(parents=True, exist_ok=True)
        self.parts.save_state(self.model, self.optimizer, self.step, self.lora.rank, folder)
        meta = {
            "base_model": self.base_model,
            "lora": self.lora.model_dump(),
            "step": self.step,
            "saved_at": time.time(),
        }
        (folder / META_FILE).write_text(json.dumps(meta))

    def load(self, folder: Path, optimizer: bool) -> None:
        """Weights (and with ``optimizer`` Adam's state and the step) from ``save``'s folder."""
        meta = read_meta(folder)
        if int(meta["lora"]["rank"]) != self.lora.rank:
            raise WireError(
                f"the checkpoint has LoRA rank {meta['lora']['rank']}, this model {self.lora.rank}"
            )
        step = self.parts.load_state(self.model, self.optimizer, self.lora.rank, folder, self.device)
        if optimizer:
            self.step = int(step) if isinstance(step, int) else int(meta.get("step", 0))
        else:
            self.optimizer = self._new_optimizer()
        self.optimizer.zero_grad(set_to_none=True)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """A copy of the trained tensors (the adapters), on the CPU: a sampler snapshot."""
        return {
            n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if p.requires_grad
        }

    @torch.no_grad()
    def merged_weights(self, adapters: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The base model's weights with the adapters added (``adapters``: a snapshot's, else the current)."""
        if adapters is None:
            return self.parts.merged_weights(self.model)
        current = self.adapter_state()
        named = dict(self.model.named_parameters())
        try:
            for n, t in adapters.items():
                named[n].copy_(t)
            return self.parts.merged_weights(self.model)
        finally:
            for n, t in current.items():
                named[n].copy_(t)


def read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta: dict[str, Any] = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        raise WireError(f"no training checkpoint of this server at {folder.name!r}") from None
    return meta


def _microbatches(data: list[Datum], budget: int) -> list[list[int]]:
    """Indices of ``data`` in groups whose padded size (rows x longest) stays within ``budget`` tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, d in enumerate(data):
        n = len(d.tokens)
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
