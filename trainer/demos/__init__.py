"""The demos behind ``agentloop demo``: GRPO on arithmetic (``arithmetic``) and on calculator tool use (``tools``)."""
