"""Key-norm eviction (Devoto et al. 2024; kvpress `KnormPress`): keys with a small L2 norm draw the most
attention, so keep the smallest norms."""

from __future__ import annotations

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView


class KNorm(EvictionPolicy):
    """Score = -||k||, per KV head."""

    prefill_per_prompt = True

    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        return -view.key.float().norm(dim=-1)  # [B, Hkv, P]
