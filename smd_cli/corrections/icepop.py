"""IcePop (Ring-1T, arXiv 2510.18855; verl `rollout_is_threshold="0.5_5.0"`): `smd_cli.losses.icepop_weights`."""

from __future__ import annotations

from smd_cli.corrections.base import Correction, check_band
from smd_cli.losses import icepop_weights


class IcePop(Correction):
    """Token ratio pi_old / pi_rollout as the weight inside [low, high], 0 outside (two-sided token mask)."""

    def __init__(self, low: float = 0.5, high: float = 5.0):
        check_band(low, high, "icepop's token-ratio band")
        self.low, self.high = float(low), float(high)

    def __call__(self, logp_old, logp_rollout, mask):
        return icepop_weights(logp_old, logp_rollout, mask, self.low, self.high)
