"""Random eviction: the selection ablation of the paper. Seeded through an explicit torch.Generator.

By definition it may drop any entry; `sink` and `window` (0 to make it fully random) are still protected.
"""

from __future__ import annotations

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView


class RandomEviction(EvictionPolicy):
    """Uniform random scores; successive rollouts draw fresh choices from one generator seeded by `seed`, whose
    state checkpoints carry (`state_dict`)."""

    def __init__(self, compression: float = 0.5, sink: int = 4, window: int = 16, seed: int = 0):
        super().__init__(compression, sink, window)
        self.seed = int(seed)
        self._generator = torch.Generator().manual_seed(self.seed)

    def state_dict(self) -> dict:
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._generator.set_state(state["generator"])

    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        batch, kv_heads, width = view.key.shape[:3]
        scores = torch.rand(batch, kv_heads, width, generator=self._generator)  # [B, Hkv, P]
        return scores.to(view.key.device)
