"""A multi-node LLM RL orchestrator whose only control plane is a shared filesystem."""

__version__ = "0.1.0"
