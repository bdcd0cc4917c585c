"""Truncated importance sampling (Yao et al. 2025): `smd_cli.losses.tis_weights`."""

from __future__ import annotations

from smd_cli.corrections.base import Correction
from smd_cli.losses import tis_weights


class TIS(Correction):
    """min(pi_old / pi_rollout, cap) per token; nothing masked."""

    def __init__(self, cap: float = 2.0):
        if not cap > 0:
            raise ValueError(f"tis needs cap > 0, got cap={cap}")
        self.cap = float(cap)

    def __call__(self, logp_old, logp_rollout, mask):
        weights, stats = tis_weights(logp_old, logp_rollout, mask, self.cap)
        return weights, mask.clone(), stats
