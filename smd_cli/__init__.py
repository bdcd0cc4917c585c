"""smd: memory-efficient RL post-training with Shadow Mask Distillation (arXiv 2605.06850)."""

__version__ = "0.1.0"
