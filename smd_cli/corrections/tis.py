"""Truncated importance sampling (Yao et al. 2025): `tis_weights`."""

from __future__ import annotations

import torch

from smd_cli.corrections.base import Correction
from smd_cli.runtime.distributed import max_over, mean_over


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (Yao et al. 2025): `min(pi_old / pi_rollout, cap)` per token."""
    valid = mask.bool()
    rho = torch.exp(torch.clamp(logp_old - logp_rollout, -20.0, 20.0))
    weights = torch.clamp(rho, max=cap)
    stats = {
        "is/weight_mean": mean_over(weights[valid]),
        "is/weight_max": max(max_over(weights[valid]), 0.0),
        "is/truncated_token_frac": mean_over((rho[valid] > cap).float()),
    }
    return weights.detach(), stats


class TIS(Correction):
    """min(pi_old / pi_rollout, cap) per token; nothing masked."""

    def __init__(self, cap: float = 2.0):
        if not cap > 0:
            raise ValueError(f"tis needs cap > 0, got cap={cap}")
        self.cap = float(cap)

    def __call__(self, logp_old, logp_rollout, mask):
        weights, stats = tis_weights(logp_old, logp_rollout, mask, self.cap)
        return weights, mask.clone(), stats
