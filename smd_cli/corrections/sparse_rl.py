"""Sparse-RL's official correction (arXiv 2601.10079, lsjia/Sparse-RL): `sparse_rl_weights`."""

from __future__ import annotations

import torch

from smd_cli.corrections.base import Correction, check_band
from smd_cli.runtime.distributed import max_over, mean_over, total


def sparse_rl_weights(
    logp_dense_old: torch.Tensor,
    logp_sparse: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 1.5,
    low: float = 0.5,
    high: float = 1.5,
    veto: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The official Sparse-RL correction (arXiv 2601.10079, lsjia/Sparse-RL).

    `rho = exp(clamp(log pi_dense_old - log pi_sparse, -20, 20))`; weights `min(rho, cap)` divided by their
    mean over valid tokens of the batch (skipped when that mean <= 1e-8); tokens with rho outside
    [low, high] are rejected; a sequence with any raw rho < veto is dropped whole. Rejected tokens leave
    their sequence's token-mean denominator too; a sequence left with none still counts among the batch's
    sequences (`SparseRL.dropped_sequences_count`). Returns weights [N, R], the kept-token mask [N, R] (bool) and statistics."""
    valid = mask.bool()
    rho = torch.exp(torch.clamp(logp_dense_old - logp_sparse, -20.0, 20.0))  # [N, R]
    weights = torch.clamp(rho, max=cap)
    mean_w = mean_over(weights[valid])
    if mean_w > 1e-8:
        weights = weights / mean_w
    token_ok = (rho >= low) & (rho <= high)
    seq_ok = ~((rho < veto) & valid).any(dim=1)  # [N]
    keep = valid & token_ok & seq_ok[:, None]
    n_valid = max(total(float(valid.sum())), 1.0)
    stats = {
        "is/weight_mean": mean_over(weights[valid]),
        "is/weight_max": max(max_over(weights[valid]), 0.0),
        "is/rejected_token_frac": total(float((valid & ~keep).sum())) / n_valid,
        "is/rejected_seq_frac": total(float((~seq_ok).sum())) / max(total(float(mask.shape[0])), 1.0),
    }
    return weights.detach(), keep, stats


class SparseRL(Correction):
    """Weights min(rho, cap) normalised to batch mean 1; tokens with rho outside [low, high] rejected; a sequence
    with any rho < veto dropped. Rejections leave the normaliser, and the mean is the batch's: batch level. Under
    `seq_mean_token_mean` a sequence with no kept token (vetoed, or every token rejected) still counts in the
    sequence normaliser and adds 0, as the official code divides by the global batch size (slime's `loss_function`)."""

    batch_level = True
    dropped_sequences_count = True

    def __init__(self, cap: float = 1.5, low: float = 0.5, high: float = 1.5, veto: float = 1e-4):
        check_band(low, high, "sparse_rl's token band")
        if cap <= 0 or veto < 0:
            raise ValueError(f"sparse_rl needs cap > 0 and veto >= 0, got cap={cap}, veto={veto}")
        self.cap, self.low, self.high, self.veto = float(cap), float(low), float(high), float(veto)

    def __call__(self, logp_old, logp_rollout, mask):
        weights, kept, stats = sparse_rl_weights(logp_old, logp_rollout, mask, self.cap, self.low, self.high, self.veto)
        return weights, kept.float(), stats
