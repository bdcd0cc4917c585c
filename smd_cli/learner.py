"""One optimisation step on a batch of rollouts, for each algorithm of DESIGN.md section 4.

| algo          | learner view            | pi_old in the ratio              | correction                       |
|---------------|-------------------------|----------------------------------|----------------------------------|
| dense         | dense                   | the first pass's own, detached   | none                             |
| naive_sparse  | dense                   | the first pass's own, detached   | none (the bias, made visible)    |
| sparse_rl     | dense                   | the first pass's own, detached   | Sparse-RL weights, rejection     |
| tis           | dense                   | the first pass's own, detached   | min(pi_old / pi_rollout, C)      |
| smd           | shadow mask (= sampler) | the sampler's own log-probs      | + lambda KL(sg[dense] || shadow) |

pi_old is the policy before the step's first update, so the dense-view algorithms read it off their first
forward (no recompute; Sparse-RL over several micro-batches excepted, whose rejections must be known before
any micro-batch's loss). SMD's one extra pass is its no-grad dense teacher, which runs only the response
rows, layer by layer beside the replay, on the replay's prompt keys and values (every prompt row is the same
in both views): SMD costs naive sparse plus R rows of a no-grad forward (DESIGN.md contract 5). The
reference policy of the KL term (`beta > 0`) is scored in the learner's own view, so that the KL is zero
at theta = ref for SMD too. Forwards return hidden states; everything over the vocabulary (log-probs,
entropy, SMD's KL) is computed in chunks (`smd_cli.scoring`), so no [N, R, V] tensor is ever held.
The optimizer may be a `MasterWeights` (bf16 compute, float32 masters): the step clips and updates
whatever parameters the optimizer holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from smd_cli import distributed
from smd_cli.distributed import LearnerPass
from smd_cli.losses import aggregate, clipped_surrogate, k3_kl, mismatch_stats, sparse_rl_weights, tis_weights
from smd_cli.rollout import RolloutBatch
from smd_cli.scoring import response_hidden, shadow_and_teacher_hidden, vocab_terms

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
    replay_backend: str = "auto"  # shadow replay kernel: auto (flex on CUDA) | sdpa | flex
    logits_chunk: int | None = None  # response tokens per vocabulary chunk; None = about 2^23 logits

    def __post_init__(self):
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name={self.name!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon


def _slices(n: int, size: int | None):
    size = n if not size else size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _hidden(model, batch: RolloutBatch, rows: slice, algo: Algorithm, shadow: bool) -> torch.Tensor:
    """Hidden states predicting the response of `rows`, [n, R, Hd]: dense, or replaying the shadow mask."""
    evict_at = batch.evict_at[rows] if shadow else None
    return response_hidden(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length, evict_at, algo.replay_backend)


def _scored(model, batch: RolloutBatch, rows: slice, algo: Algorithm, shadow: bool, teacher: bool) -> dict[str, torch.Tensor]:
    """`vocab_terms` of `rows` in the learner's view (dense or the shadow replay), with SMD's dense teacher when
    `teacher`: everything one micro-batch's loss needs, from one pass of `model`."""
    dense = None
    if teacher:  # the replay with gradient, and the dense teacher's response rows without
        hidden, dense = shadow_and_teacher_hidden(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                                                  batch.evict_at[rows], algo.replay_backend)
    else:
        hidden = _hidden(model, batch, rows, algo, shadow)
    tokens = batch.input_ids[rows, batch.prompt_length:]
    return vocab_terms(model.get_output_embeddings(), hidden, tokens, batch.response_mask[rows], algo.temperature, dense, algo.logits_chunk)


def _runner(model):
    """(forward, the model): `forward(fn, *args)` runs `fn(model, *args)`, inside the FSDP2 root's forward when
    `model` is a `LearnerPass` (sharded weights are gathered for it and their gradients reduced after it)."""
    if isinstance(model, LearnerPass):
        return model, model.model
    return (lambda fn, *args: fn(model, *args)), model


@torch.no_grad()
def _logprobs(model, batch: RolloutBatch, parts: list[slice], algo: Algorithm, shadow: bool) -> torch.Tensor:
    """Token log-probs of the whole batch under `model` without gradient, [N, R], micro-batch by micro-batch."""
    forward, _ = _runner(model)
    return torch.cat([forward(_scored, batch, s, algo, shadow, False)["logp"] for s in parts])


def _corrections(algo: Algorithm, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(weights, keep, statistics) of a dense-view algorithm's off-policy correction, given pi_old."""
    if algo.name == "sparse_rl":
        weights, kept, stats = sparse_rl_weights(old, sampler, mask, **algo.sparse_rl)
        return weights, kept.float(), stats
    if algo.name == "tis":
        weights, stats = tis_weights(old, sampler, mask, algo.tis_cap)
        return weights, mask.clone(), stats
    return torch.ones_like(mask), mask.clone(), {}


def _skipped(metrics: dict, dense_logp: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict:
    """Every token rejected (Sparse-RL): nothing to learn from, no update; the caller counts the skip."""
    return {**metrics, **mismatch_stats("mismatch/dense_", dense_logp, sampler, mask), "learner/skipped_empty_batch": 1.0}


def _trainable(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _counts(keep: torch.Tensor) -> tuple[float, float]:
    """(tokens, sequences) kept in the whole data-parallel batch: the loss normalisers."""
    return distributed.total(float(keep.sum())), distributed.total(float((keep.sum(1) > 0).sum()))


def learner_step(model, optimizer, batch: RolloutBatch, advantages: torch.Tensor, algo: Algorithm, ref_model=None) -> dict[str, float]:
    """Update `model` on `batch` (N sequences) with per-sequence `advantages` [N]; returns metrics.

    `model` may be a `LearnerPass` (FSDP2 over several processes, `smd_cli.distributed`): `batch` is then this
    rank's share, and every normaliser and metric is the whole batch's, so the update is the one-process one.
    Raises `TrainingDiverged` (without stepping) on a non-finite loss or gradient norm."""
    forward, module = _runner(model)
    n = batch.input_ids.shape[0]
    mask = batch.response_mask.float()  # [N, R]
    sampler = batch.logprobs.float()  # [N, R]
    parts = _slices(n, algo.micro_batch_size)
    smd = algo.name == "smd"
    metrics: dict[str, float] = {}

    # pi_old is the policy before this step's first update, which is exactly the first pass's own forward:
    # the dense-view algorithms take it from there, detached (as TRL does), with no extra forward. Only
    # Sparse-RL over several micro-batches scores it up front, since its rejections set every micro-batch's
    # loss normaliser. SMD's pi_old is the sampler's (its view is the sampler's); its one no-grad pass is the
    # dense teacher, per micro-batch inside the loop.
    upfront = algo.name == "sparse_rl" and len(parts) > 1
    old = sampler if smd else _logprobs(model, batch, parts, algo, shadow=False) if upfront else None
    weights, keep = torch.ones_like(mask), mask.clone()
    if upfront:
        weights, keep, stats = _corrections(algo, old, sampler, mask)
        metrics.update(stats)
    ref_logp = None
    if algo.beta > 0:
        if ref_model is None:
            raise ValueError("grpo.beta > 0 needs a reference model")
        ref_logp = _logprobs(ref_model, batch, parts, algo, shadow=smd)  # the learner's own view
    total_tokens, total_seqs = _counts(keep)
    if upfront and total_tokens == 0:
        return _skipped(metrics, old, sampler, mask)

    # Gradients left by earlier code (e.g. the warm start) must not leak in. They are zeroed, not freed: kept
    # from one step to the next, backward adds into them in place (no second copy of the largest tensor).
    optimizer.zero_grad(set_to_none=False)
    module.train()
    sums = {"loss": 0.0, "loss/policy": 0.0, "loss/kl_ref": 0.0, "loss/distill": 0.0}
    low = high = ent = 0.0
    view_logp, teacher_logp = [], []
    response_tokens, rows = distributed.total(float(mask.sum())), distributed.total(float(n))
    for iteration in range(algo.num_iterations):
        for s in parts:
            distilled = smd and algo.lam > 0
            terms = forward(_scored, batch, s, algo, smd, distilled)
            logp = terms["logp"]
            if iteration == 0:
                view_logp.append(logp.detach())
                if old is None:  # this pass is pi_old; its corrections follow from it
                    weights[s], keep[s], stats = _corrections(algo, view_logp[-1], sampler[s], mask[s])
                    if algo.name == "sparse_rl":  # one micro-batch (s is the whole batch): the normaliser is known only now
                        total_tokens, total_seqs = _counts(keep)
                        if total_tokens == 0:
                            module.eval()
                            return _skipped({**metrics, **stats}, view_logp[-1], sampler, mask)
            old_s = old[s] if old is not None else view_logp[-1]
            per_tok, clip = clipped_surrogate(logp, old_s, advantages[s], algo.epsilon, algo.epsilon_high)
            policy = aggregate(per_tok * weights[s], keep[s], algo.loss_agg, total_tokens, total_seqs)
            loss, kl_ref, distill = policy, torch.zeros(()), torch.zeros(())
            if ref_logp is not None:
                kl_ref = aggregate(k3_kl(logp, ref_logp[s]), keep[s], algo.loss_agg, total_tokens, total_seqs)
                loss = loss + algo.beta * kl_ref
            if distilled:
                if iteration == 0:
                    teacher_logp.append(terms["teacher_logp"])
                distill = aggregate(terms["kl"], mask[s], algo.loss_agg, response_tokens, rows)
                loss = loss + algo.lam * distill
            if distributed.total(float(not torch.isfinite(loss))):  # any rank: every rank stops before backward
                optimizer.zero_grad(set_to_none=True)
                raise TrainingDiverged(f"non-finite loss {loss.item()} at iteration {iteration} (policy {policy.item()}, distill {distill.item()})"
                                       if not torch.isfinite(loss) else f"non-finite loss on another rank at iteration {iteration}")
            loss.backward()
            k = keep[s].bool()  # clipping counted at every pass (the first one's ratio is 1 by construction)
            low += float((clip["low"] & k).sum()) / algo.num_iterations
            high += float((clip["high"] & k).sum()) / algo.num_iterations
            if iteration == 0:
                ent += float((terms["entropy"] * mask[s]).sum())
            for key, value in (("loss", loss), ("loss/policy", policy), ("loss/kl_ref", kl_ref), ("loss/distill", distill)):
                sums[key] += float(value.detach()) / algo.num_iterations
        if old is None:  # a dense view whose pi_old was this first pass
            old = torch.cat(view_logp)
            metrics.update(_corrections(algo, old, sampler, mask)[2])  # statistics over the whole batch
        norm = torch.nn.utils.clip_grad_norm_(_trainable(optimizer), algo.max_grad_norm)  # global under FSDP2 (a DTensor)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"non-finite gradient norm {grad_norm} at iteration {iteration}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    module.eval()

    # the dense learner's mismatch on these rollouts: SMD's teacher, or the dense view itself
    dense_logp = torch.cat(teacher_logp) if teacher_logp else None if smd else old
    metrics.update(mismatch_stats("mismatch/", torch.cat(view_logp), sampler, mask))
    if dense_logp is not None:
        metrics.update(mismatch_stats("mismatch/dense_", dense_logp, sampler, mask))
    metrics.update({key: distributed.total(value) for key, value in sums.items()})
    low, high, ent = distributed.total(low), distributed.total(high), distributed.total(ent)
    metrics.update(
        {
            "grad_norm": grad_norm,
            "entropy": ent / max(response_tokens, 1.0),
            "clip_ratio/low_mean": low / total_tokens,
            "clip_ratio/high_mean": high / total_tokens,
            "clip_ratio/region_mean": (low + high) / total_tokens,
            "learner/skipped_empty_batch": 0.0,
        }
    )
    if algo.beta > 0:
        metrics["kl"] = metrics["loss/kl_ref"]
    return metrics
