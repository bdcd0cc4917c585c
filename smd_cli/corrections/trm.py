"""Trust Region Masking (Li et al., arXiv 2512.23075; verl `rollout_rs="seq_max_k2"`): `smd_cli.losses.trm_keep`."""

from __future__ import annotations

from smd_cli.corrections.base import Correction
from smd_cli.losses import trm_keep


class TRM(Correction):
    """A sequence leaves the loss (and its normaliser) when max_t (log rho_t)^2 / 2 > threshold: batch level."""

    batch_level = True

    def __init__(self, threshold: float = 2.5):
        if not threshold > 0:
            raise ValueError(f"trm needs threshold > 0, got threshold={threshold}")
        self.threshold = float(threshold)

    def __call__(self, logp_old, logp_rollout, mask):
        return trm_keep(logp_old, logp_rollout, mask, self.threshold)
