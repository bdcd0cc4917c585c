"""Trust Region Masking (Li et al., arXiv 2512.23075; verl `rollout_rs="seq_max_k2"`): `trm_keep`."""

from __future__ import annotations

import torch

from smd_cli.corrections.base import Correction, masking_stats
from smd_cli.runtime.distributed import max_over


def trm_keep(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
             threshold: float = 2.5) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Trust Region Masking (Li et al., arXiv 2512.23075): a sequence leaves the loss whole when its largest
    token-level divergence exceeds the trust region, `max_t D(t) > threshold`, with verl's sample estimator of
    the per-token divergence `k2 = (log rho_t)^2 / 2` (`rollout_rs="seq_max_k2"`, log clamped to [-20, 20];
    2.5 is verl's example threshold). As verl's rejection sampling, rejected sequences leave the loss
    normaliser too, and no weight is applied. Returns weights (ones) [N, R], keep [N, R] (float) and
    statistics (`rollout_corr/*` and `rollout_corr/k2_max`, the largest k2 over real tokens)."""
    valid = mask.bool()
    log_rho = torch.clamp(logp_old - logp_rollout, -20.0, 20.0)
    k2 = (0.5 * log_rho.square()).masked_fill(~valid, 0.0)  # [N, R]
    inside = k2.amax(dim=1) <= threshold  # [N]; NaN: outside
    keep = valid & inside[:, None]
    weights = torch.ones_like(mask)
    stats = masking_stats(keep.to(weights.dtype), valid & ~keep, valid)
    stats["rollout_corr/k2_max"] = max(max_over(k2[valid]), 0.0)
    return weights, keep.to(mask.dtype), stats


class TRM(Correction):
    """A sequence leaves the loss (and its normaliser) when max_t (log rho_t)^2 / 2 > threshold: batch level."""

    batch_level = True

    def __init__(self, threshold: float = 2.5):
        if not threshold > 0:
            raise ValueError(f"trm needs threshold > 0, got threshold={threshold}")
        self.threshold = float(threshold)

    def __call__(self, logp_old, logp_rollout, mask):
        return trm_keep(logp_old, logp_rollout, mask, self.threshold)
