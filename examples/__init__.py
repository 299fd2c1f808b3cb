"""Runnable examples of agentloop (each folder: README.md and run.py)."""
