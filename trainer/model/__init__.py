"""The policy and value models: loading, LoRA, torch.compile, hidden-state and head forwards, the Actor and the Critic."""
