"""H2O (Zhang et al. 2023): heavy hitters plus recent tokens, evicting while it generates.

Each key accumulates the attention it receives (summed over its KV head's query group) at prefill and at
every decode step; a (row, KV head) holding more than its budget drops its lowest-scoring entry outside
the newest `window` (and the `sink` first, 0 by default). Evicted keys never come back.
"""

from __future__ import annotations

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView


class H2O(EvictionPolicy):
    """Accumulated attention; budget = heavy hitters + `window` recent entries."""

    decode_time = True
    prefill_per_prompt = True

    def __init__(self, compression: float = 0.5, sink: int = 0, window: int = 16, chunk: int | None = None):
        super().__init__(compression, sink, window)
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk (prefill query rows scored at a time) must be null (auto) or >= 1, got {chunk}")
        self.chunk = chunk

    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        received = view.attention_received(self.chunk)  # [B, H, P]
        batch, heads, width = received.shape
        return received.view(batch, heads // view.groups, view.groups, width).sum(dim=2)  # [B, Hkv, P]

    def decode_scores(self, slot_scores: torch.Tensor, attention: torch.Tensor, step: int) -> torch.Tensor:
        return slot_scores + attention

    def decode_signature(self, step: int) -> tuple:
        return ("accumulate", "evict")  # the same work at every step
