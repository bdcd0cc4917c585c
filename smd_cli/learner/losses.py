"""GRPO as small pure functions (DESIGN.md section 4); the rollout corrections' own math is in `smd_cli.corrections`.

Shapes: N sequences (prompts x G), R response positions; `mask` [N, R] is 1 on real response tokens.
Per-token terms are combined by `aggregate`, which also takes the batch-level normaliser so that
micro-batches add up to exactly the full-batch loss. The mismatch statistics are over the whole data-parallel batch
when several processes train (`smd_cli.runtime.distributed.mean_over` / `max_over`; plain for one process).
"""

from __future__ import annotations

import torch

from smd_cli.runtime.distributed import max_over, mean_over, total


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std + eps (TRL `scale_rewards`).

    `rewards` [N] holds N / group_size consecutive groups. `scale="none"` skips the division (Dr. GRPO).
    The std is the unbiased one, as in TRL."""
    grouped = rewards.view(-1, group_size)  # [N/G, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale != "none":
        raise ValueError(f"scale_rewards={scale!r}: choose 'group' or 'none'")
    return centred.reshape(-1)  # [N]


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per token: `-min(r A, clip(r, 1 - eps, 1 + eps_high) A)` with `r = exp(logp - old_logp)`.

    Returns the per-token loss [N, R] and boolean [N, R] maps of where the low/high clip was active
    (TRL's `clip_ratio/low_mean`, `clip_ratio/high_mean`)."""
    ratio = torch.exp(logp - old_logp)  # [N, R]
    adv = advantages[:, None]  # [N, 1]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    stats = {"low": (ratio < 1 - epsilon) & (adv < 0), "high": (ratio > 1 + epsilon_high) & (adv > 0), "ratio": ratio.detach()}
    return loss, stats


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) on samples of pi: `exp(q - p) - (q - p) - 1` >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def mismatch_stats(prefix: str, logp: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far a learner's log-probs are from the sampler's on real tokens: `{prefix}max_abs_diff`,
    `{prefix}mean_abs_diff` and `{prefix}kl_k3` (k3 estimate of KL(sampler || learner) on the samples)."""
    valid = mask.bool()
    if not total(float(valid.sum())):
        return {}
    diff = (logp - sampler)[valid]
    return {
        f"{prefix}max_abs_diff": max_over(diff.abs()),
        f"{prefix}mean_abs_diff": mean_over(diff.abs()),
        f"{prefix}kl_k3": mean_over(k3_kl(sampler[valid], logp[valid])),
    }


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float, total_seqs: float) -> torch.Tensor:
    """Reduce per-token values [N, R] to a scalar over this (micro-)batch, normalised for the full batch.

    token_mean: sum over all tokens / total tokens in the batch (TRL `bnpo`, verl `token-mean`).
    seq_mean_token_mean: each sequence's token mean, summed / total sequences (TRL `grpo`, Sparse-RL); a sequence
    with no token in `mask` adds 0, and whether it counts in `total_seqs` is the caller's (`Correction.normalisers`)."""
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * mask).sum() / max(total_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / max(total_seqs, 1.0)
    raise ValueError(f"loss_agg={mode!r}: choose 'token_mean' or 'seq_mean_token_mean'")
