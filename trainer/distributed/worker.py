"""TrainerWorker: the Ray actor that owns the policy (its updates, weights, checkpoints and export)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentloop.cpu_binding import usable_cpus
from trainer.config import TrainerConfig
from trainer.distributed import local_sync, weight_sync
from trainer.model.actor import Actor
from trainer.run_folder import checkpoint as ck


class TrainerWorker:
    """The Ray actor that owns the policy: updates, weights and checkpoints."""

    def __init__(self, config: TrainerConfig, model_path: str, device: str) -> None:
        torch.set_num_threads(usable_cpus())  # Ray sets OMP threads to 1 for actors
        self.actor = Actor(config, model_path, device)
        self._shared = local_sync.SharedWeights()

    def update(self, batch: Any) -> dict[str, float]:
        return self.actor.update(batch)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.actor.named_weights()

    def ipc_info(self) -> dict[str, Any]:
        """What trainer/distributed/local_sync.py needs to know: this worker's GPU (UUID) and whether it has LoRA."""
        lora = self.actor.config.actor_rollout_ref.model.lora_rank > 0
        return {"gpu": weight_sync.gpu_uuid(self.actor.device), "lora": lora}

    def share_weights(self, dtype: torch.dtype) -> tuple[Any, list[Any]]:
        """The weights in ``dtype`` as CUDA IPC handles (held until ``release_shared_weights``)."""
        return self._shared.share(self.actor.model, self.actor.device, dtype)

    def release_shared_weights(self) -> None:
        self._shared.release()

    def ready(self) -> bool:
        return True  # the model is loaded once __init__ has run

    def save_checkpoint(self, path: str) -> None:
        """Weights (safetensors) and optimizer state into a checkpoint's step folder."""
        rank = self.actor.config.actor_rollout_ref.model.lora_rank
        ck.save_policy(self.actor.model, self.actor.optimizer, self.actor.step, rank, Path(path))
        critic = self.actor.critic
        if critic is not None:  # its own weights and optimizer state, in the step's critic/ folder
            (Path(path) / ck.CRITIC_DIR).mkdir(exist_ok=True)
            ck.save_policy(critic.model, critic.optimizer, critic.step, 0, Path(path) / ck.CRITIC_DIR)

    def load_checkpoint(self, path: str) -> int:
        rank = self.actor.config.actor_rollout_ref.model.lora_rank
        got = ck.load_policy_state(
            self.actor.model, self.actor.optimizer, rank, Path(path), self.actor.device
        )
        if isinstance(got, dict):  # an older checkpoint: one actor.pt
            self.actor.load_state(got)
        else:
            self.actor.step = got
        critic = self.actor.critic
        if critic is not None:
            saved = Path(path) / ck.CRITIC_DIR
            if not (saved / ck.WEIGHTS_FILE).exists():
                raise ValueError(
                    f"the checkpoint {path} has no critic (it was written by a run without a value model); "
                    "resume with the same algorithm.adv_estimator, or start afresh with trainer.resume=disable"
                )
            got_critic = ck.load_policy_state(critic.model, critic.optimizer, 0, saved, critic.device)
            critic.step = int(got_critic) if not isinstance(got_critic, dict) else 0
        return self.actor.step

    def save_model(self, model_path: str, out_dir: str, adapter_dir: str | None) -> None:
        """The trained policy as a Hugging Face folder (LoRA merged); with LoRA also the peft adapter."""
        ck.export_hf_model(self.actor.named_weights(), model_path, Path(out_dir))
        if adapter_dir is not None:
            peft_model: Any = self.actor.model
            peft_model.save_pretrained(adapter_dir)  # peft: adapter_config.json + adapter_model.safetensors
