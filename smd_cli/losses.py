"""GRPO and its corrections as small pure functions (DESIGN.md section 4).

Shapes: N sequences (prompts x G), R response positions; `mask` [N, R] is 1 on real response tokens.
Per-token terms are combined by `aggregate`, which also takes the batch-level normaliser so that
micro-batches add up to exactly the full-batch loss. Batch statistics (Sparse-RL's mean weight, the mismatch
and importance-weight statistics) are over the whole data-parallel batch when several processes train
(`smd_cli.distributed.total` / `largest`; plain sums and maxima for one process).
"""

from __future__ import annotations

import math

import torch

from smd_cli.distributed import largest, total
from smd_cli.sampling import token_logprobs  # noqa: F401 (the log-prob formula the sampler and the learner share)


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


def _mean(values: torch.Tensor) -> float:
    """The mean over every rank's `values` (0 when there are none)."""
    count = total(float(values.numel()))
    return total(float(values.double().sum())) / count if count else 0.0


def _max(values: torch.Tensor) -> float:
    return largest(float(values.max()) if values.numel() else float("-inf"))


def mismatch_stats(prefix: str, logp: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far a learner's log-probs are from the sampler's on real tokens: `{prefix}max_abs_diff`,
    `{prefix}mean_abs_diff` and `{prefix}kl_k3` (k3 estimate of KL(sampler || learner) on the samples)."""
    valid = mask.bool()
    if not total(float(valid.sum())):
        return {}
    diff = (logp - sampler)[valid]
    return {
        f"{prefix}max_abs_diff": _max(diff.abs()),
        f"{prefix}mean_abs_diff": _mean(diff.abs()),
        f"{prefix}kl_k3": _mean(k3_kl(sampler[valid], logp[valid])),
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
    mean_w = _mean(weights[valid])
    if mean_w > 1e-8:
        weights = weights / mean_w
    token_ok = (rho >= low) & (rho <= high)
    seq_ok = ~((rho < veto) & valid).any(dim=1)  # [N]
    keep = valid & token_ok & seq_ok[:, None]
    n_valid = max(total(float(valid.sum())), 1.0)
    stats = {
        "is/weight_mean": _mean(weights[valid]),
        "is/weight_max": max(_max(weights[valid]), 0.0),
        "is/rejected_token_frac": total(float((valid & ~keep).sum())) / n_valid,
        "is/rejected_seq_frac": total(float((~seq_ok).sum())) / max(total(float(mask.shape[0])), 1.0),
    }
    return weights.detach(), keep, stats


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (Yao et al. 2025): `min(pi_old / pi_rollout, cap)` per token."""
    valid = mask.bool()
    rho = torch.exp(torch.clamp(logp_old - logp_rollout, -20.0, 20.0))
    weights = torch.clamp(rho, max=cap)
    stats = {
        "is/weight_mean": _mean(weights[valid]),
        "is/weight_max": max(_max(weights[valid]), 0.0),
        "is/truncated_token_frac": _mean((rho[valid] > cap).float()),
    }
    return weights.detach(), stats


def _masking_stats(weights: torch.Tensor, masked: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """What a rollout correction did to the batch, under verl's `rollout_corr/` prefix: the fraction of real
    tokens left without gradient (`masked_token_frac`), of sequences with at least one such token
    (`masked_seq_frac`, verl's `rollout_rs_seq_masked_fraction`), and the weights over real tokens (masked
    ones count as 0)."""
    n_valid = max(total(float(valid.sum())), 1.0)
    return {
        "rollout_corr/masked_token_frac": total(float(masked.sum())) / n_valid,
        "rollout_corr/masked_seq_frac": total(float(masked.any(dim=1).sum())) / max(total(float(valid.shape[0])), 1.0),
        "rollout_corr/weight_mean": _mean(weights[valid]),
        "rollout_corr/weight_max": max(_max(weights[valid]), 0.0),
    }


def mis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, low: float = 0.0,
                high: float = 3.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Sequence-level masked importance sampling, TRL's default `vllm_importance_sampling_mode="sequence_mask"`
    (cap `vllm_importance_sampling_cap` = 3.0; lower bound `vllm_importance_sampling_min`, 0 by default, TRL PR
    4732): the sequence ratio `rho = prod_t pi_old / pi_rollout = exp(sum_t (log pi_old - log pi_rollout))` over
    real tokens weights every token of its sequence when `low <= rho <= high`, and 0 (masked out) otherwise.
    As in TRL, a masked sequence stays in the loss normaliser (its weight is 0), so `keep` is `mask`.
    Computed in log space (a long sequence's ratio overflows float32). Returns weights [N, R] (detached),
    keep [N, R] and statistics (`rollout_corr/*`, `_masking_stats`)."""
    valid = mask.bool()
    log_seq = ((logp_old - logp_rollout) * mask).sum(dim=1)  # [N] log of the sequence ratio
    floor = math.log(low) if low > 0 else -math.inf
    inside = (log_seq >= floor) & (log_seq <= math.log(high))  # NaN: outside
    per_seq = torch.where(inside, torch.exp(log_seq.clamp(max=math.log(high))), torch.zeros_like(log_seq))
    weights = per_seq[:, None].expand(mask.shape).clone()  # [N, R]
    masked = valid & ~inside[:, None]
    return weights.detach(), mask.clone(), _masking_stats(weights, masked, valid)


def icepop_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, low: float = 0.5,
                   high: float = 5.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """IcePop (Ring-1T report, arXiv 2510.18855; verl `rollout_is_threshold="0.5_5.0"`): the token ratio
    `rho_t = pi_old / pi_rollout` (log clamped to [-20, 20], verl's safety bound) weights the token's PPO term
    when `low <= rho_t <= high` (the paper's M(k) = k inside [alpha, beta]) and 0 otherwise. The normaliser
    keeps every real token (the paper's 1/|y_i|; verl: IcePop does not modify response_mask), so `keep` is
    `mask`. Returns weights [N, R] (detached), keep [N, R] and statistics (`rollout_corr/*`)."""
    valid = mask.bool()
    rho = torch.exp(torch.clamp(logp_old - logp_rollout, -20.0, 20.0))  # [N, R]
    inside = (rho >= low) & (rho <= high)
    weights = torch.where(inside, rho, torch.zeros_like(rho))
    return weights.detach(), mask.clone(), _masking_stats(weights, valid & ~inside, valid)


def trm_keep(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
             threshold: float = 2.5) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Trust Region Masking (Li et al., arXiv 2512.23075): a sequence leaves the loss whole when its largest
    token-level divergence exceeds the trust region, `max_t D(t) > threshold`, with verl's sample estimator of
    the per-token divergence `k2 = (log rho_t)^2 / 2` (`rollout_rs="seq_max_k2"`, log clamped to [-20, 20];
    2.5 is verl's example threshold). As verl's rejection sampling, rejected sequences leave the loss
    normaliser too, and no weight is applied. Returns weights (ones) [N, R], keep [N, R] (float) and
    statistics (`rollout_corr/*` and `rollout_corr/k2_max`, the largest k2 over real tokens)."""
    valid = mask.bool()
    log_rho = torch.clamp(logp_old - logp_rollout, -20.0, 20.0)
    k2 = (0.5 * log_rho.square()).masked_fill(~valid, 0.0)  # [N, R]
    inside = k2.amax(dim=1) <= threshold  # [N]; NaN: outside
    keep = valid & inside[:, None]
    weights = torch.ones_like(mask)
    stats = _masking_stats(keep.to(weights.dtype), valid & ~keep, valid)
    stats["rollout_corr/k2_max"] = max(_max(k2[valid]), 0.0)
    return weights, keep.to(mask.dtype), stats
