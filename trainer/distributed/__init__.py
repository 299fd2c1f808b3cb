"""Training on many GPUs: FSDP2 ranks, placement on the Ray cluster, the trainer worker, weight sync into the engines."""
