"""The version of agentloop, in a module that imports nothing (``agentloop.__version__``; keep it
equal to ``version`` in pyproject.toml)."""

__version__ = "0.1.0"
