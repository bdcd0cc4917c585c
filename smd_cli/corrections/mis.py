"""Sequence-level masked importance sampling, TRL's default correction (`sequence_mask`, cap 3.0; TRL issue 4772,
PR 4732): `mis_weights`."""

from __future__ import annotations

import math

import torch

from smd_cli.corrections.base import Correction, check_band, masking_stats


def mis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, low: float = 0.0,
                high: float = 3.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Sequence-level masked importance sampling, TRL's default `vllm_importance_sampling_mode="sequence_mask"`
    (cap `vllm_importance_sampling_cap` = 3.0; lower bound `vllm_importance_sampling_min`, 0 by default, TRL PR
    4732): the sequence ratio `rho = prod_t pi_old / pi_rollout = exp(sum_t (log pi_old - log pi_rollout))` over
    real tokens weights every token of its sequence when `low <= rho <= high`, and 0 (masked out) otherwise.
    As in TRL, a masked sequence stays in the loss normaliser (its weight is 0), so `keep` is `mask`.
    Computed in log space (a long sequence's ratio overflows float32). Returns weights [N, R] (detached),
    keep [N, R] and statistics (`rollout_corr/*`, `_masking_stats`)."""
    valid = mask.bool()
    log_seq = ((logp_old - logp_rollout) * mask).sum(dim=1)  # [N] log of the sequence ratio
    floor = math.log(low) if low > 0 else -math.inf
    inside = (log_seq >= floor) & (log_seq <= math.log(high))  # NaN: outside
    per_seq = torch.where(inside, torch.exp(log_seq.clamp(max=math.log(high))), torch.zeros_like(log_seq))
    weights = per_seq[:, None].expand(mask.shape).clone()  # [N, R]
    masked = valid & ~inside[:, None]
    return weights.detach(), mask.clone(), masking_stats(weights, masked, valid)


class MIS(Correction):
    """Each sequence weighted by its ratio prod_t pi_old / pi_rollout inside [low, high], masked (weight 0)
    outside; masked sequences stay in the normaliser, as in TRL."""

    def __init__(self, low: float = 0.0, high: float = 3.0):
        check_band(low, high, "mis's sequence-ratio band")
        self.low, self.high = float(low), float(high)

    def __call__(self, logp_old, logp_rollout, mask):
        return mis_weights(logp_old, logp_rollout, mask, self.low, self.high)
