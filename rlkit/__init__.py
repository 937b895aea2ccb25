"""rlkit: compare GRPO-family RL algorithms for language models with swappable components."""

__version__ = "0.1.0"
