"""No eviction: every prompt entry stays (the dense reference run through the evicting machinery)."""

from __future__ import annotations

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView


class KeepAll(EvictionPolicy):
    """Keeps everything; its shadow mask never hides a real key, so replay equals the dense forward."""

    prefill_per_prompt = True

    def __init__(self, compression: float = 0.0, sink: int = 0, window: int = 0):
        """The budget settings are accepted (a recipe's `eviction.window` with `algo=dense`) and ignored."""
        super().__init__(compression=0.0, sink=0, window=0)

    def budget(self, prompt_lengths: torch.Tensor) -> torch.Tensor:
        return prompt_lengths.clone()

    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        batch, kv_heads, width = view.key.shape[:3]
        return torch.zeros(batch, kv_heads, width, device=view.key.device)
