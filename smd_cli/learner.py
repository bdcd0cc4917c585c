"""One optimisation step on a batch of rollouts, for each algorithm of DESIGN.md section 4.

| algo          | learner view            | pi_old in the ratio              | correction                       |
|---------------|-------------------------|----------------------------------|----------------------------------|
| dense         | dense                   | dense recompute (no grad)        | none                             |
| naive_sparse  | dense                   | dense recompute (no grad)        | none (the bias, made visible)    |
| sparse_rl     | dense                   | dense recompute (no grad)        | Sparse-RL weights, rejection     |
| tis           | dense                   | dense recompute (no grad)        | min(pi_old / pi_rollout, C)      |
| smd           | shadow mask (= sampler) | the sampler's own log-probs      | + lambda KL(sg[dense] || shadow) |

Every algorithm runs one no-grad dense forward besides the learner's: the old-policy recompute, or for
SMD the dense teacher. That is why SMD costs about what naive sparse costs (DESIGN.md contract 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from smd_cli.losses import aggregate, clipped_surrogate, distill_kl, entropy, k3_kl, mismatch_stats, sparse_rl_weights, tis_weights
from smd_cli.rollout import RolloutBatch
from smd_cli.shadow import response_logits, token_logprobs

ALGORITHMS = ("dense", "naive_sparse", "sparse_rl", "tis", "smd")


class TrainingDiverged(RuntimeError):
    """A loss or gradient was NaN or infinite; the step was not applied."""


@dataclass
class Algorithm:
    """The learner's settings (names follow TRL's GRPOConfig where one exists)."""

    name: str = "dense"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    loss_agg: str = "token_mean"
    num_iterations: int = 1
    micro_batch_size: int | None = None
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    lam: float = 0.1  # SMD distillation weight
    sparse_rl: dict = field(default_factory=lambda: {"cap": 1.5, "low": 0.5, "high": 1.5, "veto": 1e-4})
    tis_cap: float = 2.0

    def __post_init__(self):
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name={self.name!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon


def _slices(n: int, size: int | None):
    size = n if not size else size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def _dense_logits(model, batch: RolloutBatch, rows: slice) -> torch.Tensor:
    return response_logits(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length)


def _view_logits(model, batch: RolloutBatch, rows: slice, algo: Algorithm) -> torch.Tensor:
    evict_at = batch.evict_at[rows] if algo.name == "smd" else None
    return response_logits(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length, evict_at)


def learner_step(model, optimizer, batch: RolloutBatch, advantages: torch.Tensor, algo: Algorithm, ref_model=None) -> dict[str, float]:
    """Update `model` on `batch` (N sequences) with per-sequence `advantages` [N]; returns metrics.

    Raises `TrainingDiverged` (without stepping) on a non-finite loss or gradient norm."""
    P, n = batch.prompt_length, batch.input_ids.shape[0]
    tokens = batch.input_ids[:, P:]  # [N, R]
    mask = batch.response_mask.float()  # [N, R]
    sampler = batch.logprobs.float()  # [N, R]
    parts = _slices(n, algo.micro_batch_size)
    metrics: dict[str, float] = {}

    # The one no-grad dense pass: pi_old up front for the dense-learner algorithms; for SMD the teacher,
    # computed inside the loop (it needs the full-vocabulary logits, too large to keep for a whole batch).
    dense_logp = None
    if algo.name != "smd":
        dense_logp = torch.cat([token_logprobs(_dense_logits(model, batch, s), tokens[s], algo.temperature) for s in parts])
    old = sampler if algo.name == "smd" else dense_logp
    weights, keep = torch.ones_like(mask), mask.clone()
    if algo.name == "sparse_rl":
        weights, kept, stats = sparse_rl_weights(dense_logp, sampler, mask, **algo.sparse_rl)
        keep = kept.float()
        metrics.update(stats)
    elif algo.name == "tis":
        weights, stats = tis_weights(dense_logp, sampler, mask, algo.tis_cap)
        metrics.update(stats)
    ref_logp = None
    if algo.beta > 0:
        if ref_model is None:
            raise ValueError("grpo.beta > 0 needs a reference model")
        with torch.no_grad():
            ref_logp = torch.cat([token_logprobs(_dense_logits(ref_model, batch, s), tokens[s], algo.temperature) for s in parts])

    total_tokens, total_seqs = float(keep.sum()), float((keep.sum(1) > 0).sum())
    if total_tokens == 0:  # every token rejected (Sparse-RL): nothing to learn from; the caller counts the skip
        if dense_logp is not None:
            metrics.update(mismatch_stats("mismatch/dense_", dense_logp, sampler, mask))
        return {**metrics, "learner/skipped_empty_batch": 1.0}

    optimizer.zero_grad(set_to_none=True)  # gradients left by earlier code (e.g. the warm start) must not leak in
    model.train()
    sums = {"loss": 0.0, "loss/policy": 0.0, "loss/kl_ref": 0.0, "loss/distill": 0.0}
    low = high = ent = 0.0
    view_logp, teacher_logp = [], []
    for iteration in range(algo.num_iterations):
        for s in parts:
            logits = _view_logits(model, batch, s, algo)  # [n, R, V]
            logp = token_logprobs(logits, tokens[s], algo.temperature)
            per_tok, clip = clipped_surrogate(logp, old[s], advantages[s], algo.epsilon, algo.epsilon_high)
            policy = aggregate(per_tok * weights[s], keep[s], algo.loss_agg, total_tokens, total_seqs)
            loss, kl_ref, distill = policy, torch.zeros(()), torch.zeros(())
            if ref_logp is not None:
                kl_ref = aggregate(k3_kl(logp, ref_logp[s]), keep[s], algo.loss_agg, total_tokens, total_seqs)
                loss = loss + algo.beta * kl_ref
            if algo.name == "smd" and algo.lam > 0:
                teacher = _dense_logits(model, batch, s)
                if iteration == 0:
                    teacher_logp.append(token_logprobs(teacher, tokens[s], algo.temperature))
                distill = aggregate(distill_kl(teacher, logits, algo.temperature), mask[s], algo.loss_agg, float(mask.sum()), float(n))
                loss = loss + algo.lam * distill
            if not torch.isfinite(loss):
                optimizer.zero_grad(set_to_none=True)
                raise TrainingDiverged(f"non-finite loss {loss.item()} at iteration {iteration} (policy {policy.item()}, distill {distill.item()})")
            loss.backward()
            if iteration == 0:
                view_logp.append(logp.detach())
                k = keep[s].bool()
                low += float((clip["low"] & k).sum())
                high += float((clip["high"] & k).sum())
                ent += float((entropy(logits, algo.temperature) * mask[s]).sum())
            for key, value in (("loss", loss), ("loss/policy", policy), ("loss/kl_ref", kl_ref), ("loss/distill", distill)):
                sums[key] += float(value.detach()) / algo.num_iterations
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), algo.max_grad_norm)
        if not math.isfinite(float(grad_norm)):
            optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"non-finite gradient norm {float(grad_norm)} at iteration {iteration}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()

    metrics.update(mismatch_stats("mismatch/", torch.cat(view_logp), sampler, mask))
    if teacher_logp:
        dense_logp = torch.cat(teacher_logp)
    if dense_logp is not None:
        metrics.update(mismatch_stats("mismatch/dense_", dense_logp, sampler, mask))
    metrics.update(sums)
    metrics.update(
        {
            "grad_norm": float(grad_norm),
            "entropy": ent / max(float(mask.sum()), 1.0),
            "clip_ratio/low_mean": low / total_tokens,
            "clip_ratio/high_mean": high / total_tokens,
            "clip_ratio/region_mean": (low + high) / total_tokens,
            "learner/skipped_empty_batch": 0.0,
        }
    )
    if algo.beta > 0:
        metrics["kl"] = sums["loss/kl_ref"]
    return metrics
