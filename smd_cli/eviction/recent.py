"""StreamingLLM (Xiao et al. 2023): attention sinks plus the most recent tokens.

Unlike the original, positions are not re-rotated inside the cache: keys keep their true RoPE positions,
so that the learner can replay exactly what the sampler saw.
"""

from __future__ import annotations

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView


class Recent(EvictionPolicy):
    """Keeps the first `sink` tokens and the newest `k - sink` ones (the score is the position)."""

    prefill_per_prompt = True

    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        batch, kv_heads, width = view.key.shape[:3]
        position = torch.arange(width, device=view.key.device, dtype=torch.float32)
        return position.expand(batch, kv_heads, width)
