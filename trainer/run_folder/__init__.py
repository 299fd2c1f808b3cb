"""Checkpoints, the run folder's identity and what changed, metric sinks and the report: what a run keeps on disk."""
