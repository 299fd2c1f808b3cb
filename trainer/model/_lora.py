"""LoRA on the policy through peft: wrapping the model (only the adapters train) and the merged weights
the engines load (the base model's own names and shapes, each adapter's delta added)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.config import TrainerConfig


def wrap_lora(model: nn.Module, config: TrainerConfig) -> nn.Module:
    """``model`` with LoRA adapters (peft): only the adapters train; the base weights stay frozen.

    With gradient checkpointing on, peft makes the (frozen) embeddings' output require grad itself,
    so the adapters inside checkpointed layers get gradients."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError(
            "actor_rollout_ref.model.lora_rank > 0 needs peft: `pip install peft` (or lora_rank=0)"
        ) from exc
    m = config.actor_rollout_ref.model
    lora = LoraConfig(
        r=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=m.target_modules, task_type="CAUSAL_LM"
    )
    try:
        return get_peft_model(model, lora)  # type: ignore[arg-type]
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        linear = sorted({n.rsplit(".", 1)[-1] for n, x in model.named_modules() if isinstance(x, nn.Linear)})
        raise ValueError(
            f"actor_rollout_ref.model.target_modules={m.target_modules!r} does not fit this model ({exc}); "
            f"use 'all-linear' or a list of its linear layers' names: {linear}"
        ) from None


@torch.no_grad()
def merged_lora_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own names and shapes) with each LoRA delta added, on CPU.

    What ``merge_and_unload`` would give, without copying the model or touching its base weights:
    each adapted ``<name>.base_layer.weight`` becomes ``<name>.weight`` plus B @ A * scale.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or module.merged or module.disable_adapters:
            continue  # merged: the delta is already in the base weight; disabled: it does not apply
        active = [a for a in module.active_adapters if a in module.lora_A]
        if active and (
            not hasattr(module, "get_delta_weight") or any(module.use_dora.get(a) for a in active)
        ):
            raise NotImplementedError(f"merging the LoRA adapter of {name} ({type(module).__name__})")
        for adapter in active:
            delta = module.get_delta_weight(adapter)  # type: ignore[attr-defined]  # (out, in) like the weight
            key = f"{name}.weight"
            deltas[key] = deltas[key] + delta if key in deltas else delta
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        parts = key.split(".")
        if any(p.startswith("lora_") for p in parts):
            continue  # adapter tensors (lora_A, lora_B, lora_magnitude_vector, ...)
        name = ".".join(p for p in parts if p != "base_layer")
        merged = value + deltas[name].to(value.dtype) if name in deltas else value
        out[name] = merged.detach().to("cpu", copy=True)
    return out
