"""Rollout corrections: how a learner weights or masks tokens and sequences against the sampler's log-probs.
One class per file; `conf/algo/<name>.yaml` names it under `algo.correction._target_`."""

from smd_cli.corrections.base import Correction

__all__ = ["Correction"]
