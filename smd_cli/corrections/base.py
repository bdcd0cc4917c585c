"""The shape every rollout correction has (the eviction policies' shape: a small class beside its math, a pure
function, named by a YAML file).

A correction sees the learner's pi_old and the sampler's log-probs on the real response tokens and returns,
per token, a weight on the PPO term and whether the token counts in the loss normaliser. `learner_step`
applies them the same way whatever the correction is; it never asks which one it holds.
"""

from __future__ import annotations

import torch

from smd_cli.runtime.distributed import max_over, mean_over, total


class Correction:
    """Base class. `__call__(logp_old, logp_rollout, mask)`, all [N, R] (mask 1 on real tokens), returns
    (weights [N, R] detached, keep [N, R] in mask's dtype: the tokens the loss sums and normalises over,
    statistics: plain floats over the whole batch, named by the correction)."""

    # True when the weights or the kept tokens depend on the whole batch (a batch-mean normaliser, tokens that
    # leave the loss denominator): with several micro-batches, pi_old is then scored for the whole batch first.
    batch_level: bool = False
    # How `loss_agg=seq_mean_token_mean` counts sequences. False (verl's default): only those with a kept token, a
    # sequence dropped whole leaves the count. True (slime's division by the global batch size, which Sparse-RL
    # runs on): every sequence of the batch, a dropped one adding 0 to the sum.
    dropped_sequences_count: bool = False

    def normalisers(self, keep: torch.Tensor) -> tuple[float, float]:
        """(tokens, sequences) over the whole data-parallel batch, the loss normalisers: `keep`'s tokens, and the
        sequences `dropped_sequences_count` says (`keep` [N, R] as this correction returned it)."""
        sequences = keep.shape[0] if self.dropped_sequences_count else (keep.sum(1) > 0).sum()
        return total(float(keep.sum())), total(float(sequences))

    def __call__(self, logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)


def check_band(low: float, high: float, name: str) -> None:
    """A ratio band [low, high] with 0 <= low < high (`name` for the message)."""
    if not (0.0 <= low < high):
        raise ValueError(f"{name} needs 0 <= low < high, got low={low}, high={high}")


def masking_stats(weights: torch.Tensor, masked: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """What a rollout correction did to the batch, under verl's `rollout_corr/` prefix: the fraction of real
    tokens left without gradient (`masked_token_frac`), of sequences with at least one such token
    (`masked_seq_frac`, verl's `rollout_rs_seq_masked_fraction`), and the weights over real tokens (masked
    ones count as 0)."""
    n_valid = max(total(float(valid.sum())), 1.0)
    return {
        "rollout_corr/masked_token_frac": total(float(masked.sum())) / n_valid,
        "rollout_corr/masked_seq_frac": total(float(masked.any(dim=1).sum())) / max(total(float(valid.shape[0])), 1.0),
        "rollout_corr/weight_mean": mean_over(weights[valid]),
        "rollout_corr/weight_max": max(max_over(weights[valid]), 0.0),
    }
