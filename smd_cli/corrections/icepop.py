"""IcePop (Ring-1T, arXiv 2510.18855; verl `rollout_is_threshold="0.5_5.0"`): `icepop_weights`."""

from __future__ import annotations

import torch

from smd_cli.corrections.base import Correction, check_band, masking_stats


def icepop_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, low: float = 0.5,
                   high: float = 5.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """IcePop (Ring-1T report, arXiv 2510.18855; verl `rollout_is_threshold="0.5_5.0"`): the token ratio
    `rho_t = pi_old / pi_rollout` (log clamped to [-20, 20], verl's safety bound) weights the token's PPO term
    when `low <= rho_t <= high` (the paper's M(k) = k inside [alpha, beta]) and 0 otherwise. The normaliser
    keeps every real token (the paper's 1/|y_i|; verl: IcePop does not modify response_mask), so `keep` is
    `mask`. Returns weights [N, R] (detached), keep [N, R] and statistics (`rollout_corr/*`)."""
    valid = mask.bool()
    rho = torch.exp(torch.clamp(logp_old - logp_rollout, -20.0, 20.0))  # [N, R]
    inside = (rho >= low) & (rho <= high)
    weights = torch.where(inside, rho, torch.zeros_like(rho))
    return weights.detach(), mask.clone(), masking_stats(weights, valid & ~inside, valid)


class IcePop(Correction):
    """Token ratio pi_old / pi_rollout as the weight inside [low, high], 0 outside (two-sided token mask)."""

    def __init__(self, low: float = 0.5, high: float = 5.0):
        check_band(low, high, "icepop's token-ratio band")
        self.low, self.high = float(low), float(high)

    def __call__(self, logp_old, logp_rollout, mask):
        return icepop_weights(logp_old, logp_rollout, mask, self.low, self.high)
