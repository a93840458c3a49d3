"""moe-gspo: reinforcement learning on Mixture-of-Experts LLMs, with routing-stability measurement."""

__version__ = "0.1.0"
