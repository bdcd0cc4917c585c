"""No correction: every real token weighs 1 (dense GRPO, naive sparse training, SMD, whose view is the sampler's)."""

from __future__ import annotations

import torch

from smd_cli.corrections.base import Correction


class NoCorrection(Correction):
    def __call__(self, logp_old, logp_rollout, mask):
        return torch.ones_like(mask), mask.clone(), {}
