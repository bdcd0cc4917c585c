"""Sparse-RL's official correction (arXiv 2601.10079, lsjia/Sparse-RL): `smd_cli.losses.sparse_rl_weights`."""

from __future__ import annotations

from smd_cli.corrections.base import Correction, check_band
from smd_cli.losses import sparse_rl_weights


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
