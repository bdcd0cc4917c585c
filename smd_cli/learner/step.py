"""One optimisation step on a batch of rollouts, for any algorithm of DESIGN.md section 4.

An algorithm is a composition (`Algorithm`): the view the learner scores (dense, or the rollout's shadow mask
replayed), a rollout correction that weights or masks tokens and sequences against the sampler's log-probs
(`smd_cli.corrections`, one class per file), and whether SMD's distillation term is added. `learner_step` is
one loop over these pieces and never asks for an algorithm's name. The built-in algorithms (conf/algo/):

| algo          | learner view            | pi_old in the ratio              | correction                           |
|---------------|-------------------------|----------------------------------|--------------------------------------|
| dense         | dense                   | the first pass's own, detached   | none                                 |
| naive_sparse  | dense                   | the first pass's own, detached   | none (the bias, made visible)        |
| sparse_rl     | dense                   | the first pass's own, detached   | Sparse-RL weights, rejection         |
| tis           | dense                   | the first pass's own, detached   | min(pi_old / pi_rollout, C)          |
| mis           | dense                   | the first pass's own, detached   | sequence ratio in [0, 3], else 0     |
| icepop        | dense                   | the first pass's own, detached   | token ratio in [0.5, 5], else 0      |
| trm           | dense                   | the first pass's own, detached   | sequence out when max k2 > 2.5       |
| smd           | shadow mask (= sampler) | the sampler's own log-probs      | none; + lambda KL(sg[dense] || shadow) |

pi_old is the policy before the step's first update, so the dense-view algorithms read it off their first
forward (no recompute; a `batch_level` correction over several micro-batches excepted, Sparse-RL's or TRM's,
whose rejections must be known before any micro-batch's loss). SMD's one extra pass is its no-grad dense
teacher, which runs only the response rows, layer by layer beside the replay, on the replay's prompt keys and values (every prompt row is the same
in both views): SMD costs naive sparse plus R rows of a no-grad forward (DESIGN.md contract 5). The
reference policy of the KL term (`beta > 0`) is scored in the learner's own view, so that the KL is zero
at theta = ref for SMD too. Forwards return hidden states; everything over the vocabulary (log-probs,
entropy, SMD's KL and the agreement of its two views, `smd_cli.learner.agreement`) is computed in chunks (`smd_cli.learner.forward`), so no
[N, R, V] tensor is ever held.
The optimizer may be a `MasterWeights` (bf16 compute, float32 masters): the step clips and updates
whatever parameters the optimizer holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from smd_cli.corrections.base import Correction
from smd_cli.corrections.icepop import IcePop
from smd_cli.corrections.mis import MIS
from smd_cli.corrections.none import NoCorrection
from smd_cli.corrections.sparse_rl import SparseRL
from smd_cli.corrections.tis import TIS
from smd_cli.corrections.trm import TRM
from smd_cli.learner.agreement import summary as agreement_summary
from smd_cli.learner.forward import response_hidden, shadow_and_teacher_hidden, vocab_terms
from smd_cli.learner.losses import aggregate, clipped_surrogate, k3_kl, mismatch_stats
from smd_cli.model.build import learner_mode
from smd_cli.options import VIEWS
from smd_cli.rollout.sampler import RolloutBatch
from smd_cli.runtime import distributed
from smd_cli.runtime.distributed import LearnerPass
from smd_cli.runtime.failures import TrainingDiverged

# The compositions of conf/algo/NAME.yaml (view, correction, distill), for callers that name a built-in algorithm
# (tests, benchmarks); the stage builds its algorithm from the YAML itself. Tested equal to the YAML files.
BUILT_IN = {
    "dense": ("dense", NoCorrection, False),
    "naive_sparse": ("dense", NoCorrection, False),
    "sparse_rl": ("dense", SparseRL, False),
    "tis": ("dense", TIS, False),
    "mis": ("dense", MIS, False),
    "icepop": ("dense", IcePop, False),
    "trm": ("dense", TRM, False),
    "smd": ("shadow", NoCorrection, True),
}
ALGORITHMS = tuple(BUILT_IN)


@dataclass
class Algorithm:
    """The learner's settings (names follow TRL's GRPOConfig where one exists) and the algorithm's composition:
    `view` (VIEWS), `correction` (a `Correction`) and `distill` (add lambda * KL(sg[dense] || view), SMD's term;
    needs the shadow view). Left None, they are those of the built-in algorithm `name` (BUILT_IN)."""

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
    replay_backend: str = "auto"  # shadow replay kernel: auto (flex on CUDA) | sdpa | flex
    logits_chunk: int | None = None  # response tokens per vocabulary chunk; None = about 2^23 logits
    view: str | None = None
    correction: Correction | None = None
    distill: bool | None = None

    def __post_init__(self):
        if self.view is None or self.correction is None or self.distill is None:
            if self.name not in BUILT_IN:
                raise ValueError(f"algo.name={self.name!r}: choose one of {', '.join(ALGORITHMS)}, or give its view, correction "
                                 "and distill")
            view, correction, distill = BUILT_IN[self.name]
            self.view = view if self.view is None else self.view
            self.correction = correction() if self.correction is None else self.correction
            self.distill = distill if self.distill is None else self.distill
        if self.view not in VIEWS:
            raise ValueError(f"algo.view={self.view!r}: choose one of {', '.join(VIEWS)}")
        if self.distill and self.view != "shadow":
            raise ValueError("algo.distill=true (SMD's KL from the dense teacher to the learner's view) needs algo.view=shadow")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon


def _slices(n: int, size: int | None):
    size = n if not size else size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _hidden(model, batch: RolloutBatch, rows: slice, algo: Algorithm, shadow: bool) -> torch.Tensor:
    """Hidden states predicting the response of `rows`, [n, R, Hd]: dense, or replaying the shadow mask."""
    evict_at = batch.evict_at[rows] if shadow else None
    return response_hidden(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length, evict_at, algo.replay_backend,
                           batch.cache_reads(rows) if shadow else None)


def scored(model, batch: RolloutBatch, rows: slice | torch.Tensor, algo: Algorithm, shadow: bool, teacher: bool) -> dict[str, torch.Tensor]:
    """`vocab_terms` of `rows` (a slice, or row indices) in the learner's view (dense or the shadow replay), with SMD's
    dense teacher when `teacher`, over the sampler's recorded kept token set when it truncated one (top-k / top-p; the
    same set in every view, whatever its logits): everything one micro-batch's loss needs, from one pass of `model`.
    Public: the TRL integration (`smd_cli.integrations.trl`) scores TRL's micro-batches with it."""
    dense = None
    if teacher:  # the replay with gradient, and the dense teacher's response rows without
        hidden, dense = shadow_and_teacher_hidden(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                                                  batch.evict_at[rows], algo.replay_backend, batch.cache_reads(rows))
    else:
        hidden = _hidden(model, batch, rows, algo, shadow)
    tokens = batch.input_ids[rows, batch.prompt_length:]
    support = None if batch.sampling_support is None else batch.sampling_support.rows(rows)  # top-k / top-p: the sampler's kept set
    return vocab_terms(model.get_output_embeddings(), hidden, tokens, batch.response_mask[rows], algo.temperature, dense, algo.logits_chunk,
                       support)


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
    return torch.cat([forward(scored, batch, s, algo, shadow, False)["logp"] for s in parts])


def _skipped(metrics: dict, sampler: torch.Tensor, mask: torch.Tensor, dense_logp: torch.Tensor | None) -> dict:
    """Every token rejected (Sparse-RL, TRM): nothing to learn from, no update; the caller counts the skip."""
    if dense_logp is not None:
        metrics = {**metrics, **mismatch_stats("mismatch/dense_", dense_logp, sampler, mask)}
    return {**metrics, "learner/skipped_empty_batch": 1.0}


def _trainable(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def learner_step(model, optimizer, batch: RolloutBatch, advantages: torch.Tensor, algo: Algorithm, ref_model=None,
                 check: Callable[[dict], None] | None = None) -> dict[str, float]:
    """Update `model` on `batch` (N sequences) with per-sequence `advantages` [N]; returns metrics.

    `model` may be a `LearnerPass` (FSDP2 over several processes, `smd_cli.runtime.distributed`): `batch` is then this
    rank's share, and every normaliser and metric is the whole batch's, so the update is the one-process one.
    The forward runs in `models.learner_mode`: no dropout, no router jitter, the function the sampler ran. `check`,
    when given, reads the first pass's mismatch with the sampler (`mismatch/*`) after its backward and before the
    first optimizer step, at the weights the rollout was drawn with; it may raise to stop the step (no update).
    Raises `TrainingDiverged` (without stepping) on a non-finite loss or gradient norm."""
    forward, module = _runner(model)
    n = batch.input_ids.shape[0]
    mask = batch.response_mask.float()  # [N, R]
    sampler = batch.logprobs.float()  # [N, R]
    parts = _slices(n, algo.micro_batch_size)
    shadow, correct = algo.view == "shadow", algo.correction
    metrics: dict[str, float] = {}

    # pi_old is the policy before this step's first update. The shadow view is the sampler's, so its pi_old is the
    # sampler's log-probs; a dense view's is exactly its first pass's own forward, taken from there, detached (as
    # TRL does), with no extra forward. Only a batch-level correction over several micro-batches scores it up
    # front, since its rejections set every micro-batch's loss normaliser. SMD's one no-grad pass is the dense
    # teacher, per micro-batch inside the loop.
    upfront = correct.batch_level and len(parts) > 1 and not shadow
    old = sampler if shadow else _logprobs(model, batch, parts, algo, shadow=False) if upfront else None
    weights, keep = torch.ones_like(mask), mask.clone()
    if old is not None:
        weights, keep, stats = correct(old, sampler, mask)
        metrics.update(stats)
    ref_logp = None
    if algo.beta > 0:
        if ref_model is None:
            raise ValueError("grpo.beta > 0 needs a reference model")
        ref_logp = _logprobs(ref_model, batch, parts, algo, shadow=shadow)  # the learner's own view
    total_tokens, total_seqs = correct.normalisers(keep)
    if old is not None and total_tokens == 0:
        return _skipped(metrics, sampler, mask, None if shadow else old)

    # Gradients left by earlier code (e.g. the warm start) must not leak in. They are zeroed, not freed: kept
    # from one step to the next, backward adds into them in place (no second copy of the largest tensor).
    optimizer.zero_grad(set_to_none=False)
    learner_mode(module)
    sums = {"loss": 0.0, "loss/policy": 0.0, "loss/kl_ref": 0.0, "loss/distill": 0.0}
    low = high = ent = 0.0
    view_logp, teacher_logp, agreements = [], [], []  # agreements: SMD's, per real token (smd_cli.learner.agreement)
    response_tokens, rows = distributed.total(float(mask.sum())), distributed.total(float(n))
    distilled = algo.distill and algo.lam > 0
    for iteration in range(algo.num_iterations):
        for s in parts:
            terms = forward(scored, batch, s, algo, shadow, distilled)
            logp = terms["logp"]
            if iteration == 0:
                view_logp.append(logp.detach())
                if old is None:  # this pass is pi_old; its corrections follow from it
                    weights[s], keep[s], stats = correct(view_logp[-1], sampler[s], mask[s])
                    if correct.batch_level:  # one micro-batch (s is the whole batch): the normaliser is known only now
                        total_tokens, total_seqs = correct.normalisers(keep)
                        if total_tokens == 0:
                            module.eval()
                            return _skipped({**metrics, **stats}, sampler, mask, view_logp[-1])
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
                    agreements.append(terms["agreement"][mask[s].bool()])
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
        if iteration == 0:  # the first pass's parity with the sampler, judged before any update
            first = mismatch_stats("mismatch/", torch.cat(view_logp), sampler, mask)
            if check is not None:
                try:
                    check(first)
                except BaseException:
                    module.eval()
                    raise
        if old is None:  # a dense view whose pi_old was this first pass
            old = torch.cat(view_logp)
            metrics.update(correct(old, sampler, mask)[2])  # statistics over the whole batch
        norm = torch.nn.utils.clip_grad_norm_(_trainable(optimizer), algo.max_grad_norm)  # global under FSDP2 (a DTensor)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"non-finite gradient norm {grad_norm} at iteration {iteration}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    module.eval()

    # the dense learner's mismatch on these rollouts: SMD's teacher, or the dense view itself
    dense_logp = torch.cat(teacher_logp) if teacher_logp else None if shadow else old
    metrics.update(first)
    if dense_logp is not None:
        metrics.update(mismatch_stats("mismatch/dense_", dense_logp, sampler, mask))
    if agreements:  # SMD: its shadow view (the sampler's) against its dense teacher, free (smd_cli.learner.agreement)
        metrics.update(agreement_summary(torch.cat(agreements)))
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
