"""Sequence-level masked importance sampling, TRL's default correction (`sequence_mask`, cap 3.0; TRL issue 4772,
PR 4732): `smd_cli.losses.mis_weights`."""

from __future__ import annotations

from smd_cli.corrections.base import Correction, check_band
from smd_cli.losses import mis_weights


class MIS(Correction):
    """Each sequence weighted by its ratio prod_t pi_old / pi_rollout inside [low, high], masked (weight 0)
    outside; masked sequences stay in the normaliser, as in TRL."""

    def __init__(self, low: float = 0.0, high: float = 3.0):
        check_band(low, high, "mis's sequence-ratio band")
        self.low, self.high = float(low), float(high)

    def __call__(self, logp_old, logp_rollout, mask):
        return mis_weights(logp_old, logp_rollout, mask, self.low, self.high)
