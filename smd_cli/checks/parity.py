"""The lr = 0 protocol that validates a sampler/learner pair: the learner's log-probs at the sampler's own weights.

RL frameworks check that the learner scores a rollout as the sampler did by taking a training step that changes
nothing (learning rate 0) and comparing its log-probs with the sampler's (prime-rl's check requires a mismatch
KL under 0.015; ../shared/REFERENCES.md section 9). Here each learner view of one evicting rollout is compared
with the sampler's log-probs on every real response token (over the sampler's recorded kept token set when top-k /
top-p truncated it, in every view):
- `shadow`: `learner_step` at lr = 0 with the shadow replay (SMD's view): must equal the sampler;
- `dense`: `learner_step` at lr = 0 with the dense view: the mismatch a dense learner trains with (reported,
  not judged);
- `physical`: the physical-eviction learner (`smd_cli.learner.physical`): must equal the sampler;
- `shadow_float64`: the shadow replay with the model and the replay in float64 (no gradient). Float32 rounding
  is gone from the learner's side there, so it separates the two ways a view can miss the sampler: a mask or
  KV error (the replay is not what the sampler attended to) survives float64; float32 rounding does not
  (DESIGN.md section 6). What is left of the sampler's own float32 rounding is of the order of the learner's,
  measured on the same batch (`rounding`: the largest |float32 replay - float64 replay|), so a float64 miss
  beyond `bound` and beyond ROUNDING_FACTOR times that is a mask error.
The check fails (the caller raises `ParityFailed`) when the shadow or physical view misses the sampler beyond
`bound`, or the float64 replay shows a mask error; the verdict says which of the two explains a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from smd_cli.attention.kv_quant import CacheReads
from smd_cli.attention.shadow import none_evicted
from smd_cli.corrections.none import NoCorrection
from smd_cli.learner.forward import response_hidden, vocab_terms
from smd_cli.learner.losses import mismatch_stats
from smd_cli.learner.physical import physical_response_logits
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.model import widening
from smd_cli.rollout.sampler import RolloutBatch
from smd_cli.rollout.sampling import token_logprobs

JUDGED = ("shadow", "physical")  # the float32 views that must give the sampler's log-probs within the bound
ROUNDING_FACTOR = 10.0  # a float64 replay missing the sampler by more than this times float32 rounding: a mask error


@dataclass
class Settings:
    """How the learner scores (the train stage's knobs of the same names) and what is checked."""

    temperature: float = 1.0
    micro_batch_size: int | None = None
    logits_chunk: int | None = None
    replay_backend: str = "auto"
    physical: bool = True
    float64: bool = True


def _stats(logp: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
    found = mismatch_stats("", logp.double(), batch.logprobs.double(), batch.response_mask)
    return {"max_abs_diff": found["max_abs_diff"], "mean_abs_diff": found["mean_abs_diff"], "kl_k3": found["kl_k3"]}


def learner_at_lr_zero(model, batch: RolloutBatch, view: str, settings: Settings) -> dict[str, float]:
    """`learner_step` in `view` with a learning rate of 0 (the weights stay bit for bit): its own mismatch
    statistics against the sampler, from the very forward the training step runs."""
    algo = Algorithm(f"parity/{view}", view=view, correction=NoCorrection(), distill=False, temperature=settings.temperature,
                     micro_batch_size=settings.micro_batch_size, logits_chunk=settings.logits_chunk,
                     replay_backend=settings.replay_backend)
    params = [p for p in model.parameters() if p.requires_grad]
    metrics = learner_step(model, torch.optim.SGD(params, lr=0.0), batch, torch.zeros(batch.input_ids.shape[0]), algo)
    for p in params:
        p.grad = None
    return {key: metrics[f"mismatch/{key}"] for key in ("max_abs_diff", "mean_abs_diff", "kl_k3")}


@torch.no_grad()
def physical_view(model, batch: RolloutBatch, temperature: float) -> dict[str, float]:
    tokens = batch.input_ids[:, batch.prompt_length:]
    logits = physical_response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at,
                                      batch.cache_reads())
    return _stats(token_logprobs(logits, tokens, temperature, batch.sampling_support), batch)


@torch.no_grad()
def _replay_logp(model, batch: RolloutBatch, temperature: float, logits_chunk: int | None, evict_at=None, quant: str = "recorded",
                 flips: list | None = None) -> torch.Tensor:
    """The sdpa replay's log-probs [N, R] (no gradient) of `evict_at` (the batch's by default), reading keys and values
    through the batch's 8-bit cache (`quant` "recorded": with its rounding record, as the learner does; "own": the
    learner's own rounding; "none": full precision), counting each layer's codes the record changed into `flips`."""
    evict_at = batch.evict_at if evict_at is None else evict_at
    reads = None if quant == "none" else batch.cache_reads()
    if reads is not None:
        reads = CacheReads(reads.kind, None if quant == "own" else reads.rounding, flips)
    hidden = response_hidden(model, batch.input_ids, batch.attention_mask, batch.prompt_length, evict_at, "sdpa", reads)
    return vocab_terms(model.get_output_embeddings(), hidden, batch.input_ids[:, batch.prompt_length:], batch.response_mask,
                       temperature, chunk=logits_chunk, support=batch.sampling_support)["logp"]


def rows_of(batch: RolloutBatch, rows: slice) -> RolloutBatch:
    """The rollout's rows `rows`, everything a replay reads of them."""
    cut = (lambda t: None if t is None else t[rows])
    support = None if batch.sampling_support is None else batch.sampling_support.rows(rows)
    return replace(batch, input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows], response_mask=batch.response_mask[rows],
                   logprobs=batch.logprobs[rows], evict_at=cut(batch.evict_at), visibility=cut(batch.visibility), sampling_support=support,
                   kv_rounding=cut(batch.kv_rounding), stats={})


def float64_replay(model, batch: RolloutBatch, temperature: float, logits_chunk: int | None = None,
                   micro_batch: int | None = None) -> dict[str, float]:
    """The shadow replay with `model` in float64 (`smd_cli.model.widening`: one layer's tensors widened at a time, no float64
    copy of the model; SDPA, no gradient; eval mode), `micro_batch` rows at a time, against the sampler, and `rounding`: the largest
    |float32 replay - float64 replay|, the learner's own float32 rounding on this batch, the scale at which the
    sampler's float32 log-probs are rounded too."""
    n, modes = batch.input_ids.shape[0], [(m, m.training) for m in model.modules()]
    narrow, wide = [], []
    model.eval()  # the sampler's function, whatever mode the caller left it in (the learner's, inside its step)
    try:
        for start in range(0, n, micro_batch or n):
            part = rows_of(batch, slice(start, min(start + (micro_batch or n), n)))
            narrow.append(_replay_logp(model, part, temperature, logits_chunk))
            with widening.float64(model):
                wide.append(_replay_logp(model, part, temperature, logits_chunk))
    finally:
        for module, training in modes:
            module.training = training
    narrow, logp = torch.cat(narrow), torch.cat(wide)
    rounding = float((narrow.double() - logp)[batch.response_mask].abs().max()) if batch.response_mask.any() else 0.0
    return {**_stats(logp, batch), "rounding": rounding}


@torch.no_grad()
def mismatch_parts(model, batch: RolloutBatch, settings: Settings) -> dict[str, dict[str, float]]:
    """Under an 8-bit kv.quant (reported, not judged): the dense view's mismatch (both approximations) in its two parts,
    `quant_only`, what the quantisation alone costs a learner: the shadow mask replayed on full-precision keys and
    values, and `evict_only`, what the eviction alone costs: every key visible, read through the cache's codes; and
    `own_rounding`, the shadow replay rounding its own keys and values without the rollout's record, with `flips`, the
    codes (of entries a decode step held) where that rounding differs from the sampler's (`kv_quant.CacheReads.flips`)."""
    alone = none_evicted(batch.evict_at, batch.attention_mask)
    flips: list[int] = []
    args = (model, batch, settings.temperature, settings.logits_chunk)
    own = _stats(_replay_logp(*args, quant="own"), batch)
    _replay_logp(*args, flips=flips)
    return {"quant_only": _stats(_replay_logp(*args, quant="none"), batch),
            "evict_only": _stats(_replay_logp(*args, alone), batch),
            "own_rounding": {**own, "flips": sum(flips)}}


def mask_error(views: dict, bound: float) -> bool:
    """Whether the float64 replay misses the sampler by more than rounding explains: beyond `bound` and beyond
    ROUNDING_FACTOR times the learner's own float32 rounding (the sampler's is of the same order)."""
    wide = views.get("shadow_float64")
    return wide is not None and wide["max_abs_diff"] > max(bound, ROUNDING_FACTOR * wide["rounding"])


def beyond_rounding(parity: float, wide: dict, bound: float) -> bool:
    """Whether a learner's float32 parity `parity` is more than rounding explains, given the float64 replay of the same
    batch at the same weights (`wide`, `float64_replay`'s): the learner's forward runs the replay's function, so it can
    miss the sampler by at most the replay's float32 rounding plus the float64 replay's own miss; beyond `bound` and
    ROUNDING_FACTOR times that sum, the learner computes something else than its replay (a training-mode behaviour
    such as dropout or router jitter, or an error of the learner's own path), whatever the mask."""
    return parity > max(bound, ROUNDING_FACTOR * (wide["rounding"] + wide["max_abs_diff"]))


def check(model, batch: RolloutBatch, settings: Settings, bound: float) -> dict:
    """Every view's statistics against the sampler (`views`), whether the check passed (`passed`: every judged
    view within `bound`, and no mask error read off the float64 replay), the failing views (`failed`) and a
    one-line `verdict`. Dense rollouts (no shadow mask) have no physical view."""
    views = {"shadow": learner_at_lr_zero(model, batch, "shadow", settings),
             "dense": learner_at_lr_zero(model, batch, "dense", settings)}
    if settings.physical and batch.evict_at is not None:
        views["physical"] = physical_view(model, batch, settings.temperature)
    if settings.float64:
        views["shadow_float64"] = float64_replay(model, batch, settings.temperature, settings.logits_chunk, settings.micro_batch_size)
    if batch.kv_quant != "none" and batch.evict_at is not None:
        views.update(mismatch_parts(model, batch, settings))
    failed = [v for v in JUDGED if v in views and not views[v]["max_abs_diff"] <= bound]
    if mask_error(views, bound):
        failed.append("shadow_float64")
    return {"views": views, "passed": not failed, "failed": failed, "verdict": verdict(views, failed, bound)}


def verdict(views: dict, failed: list[str], bound: float) -> str:
    """What a failure means, read off the float64 replay."""
    if not failed:
        return f"every learner view that must give the sampler's log-probs does, within {bound:g}"
    worst = ", ".join(f"{v} {views[v]['max_abs_diff']:.3g}" for v in failed)
    wide = views.get("shadow_float64")
    if wide is None:
        return f"beyond the bound {bound:g}: {worst} (run the float64 replay to tell a mask error from rounding)"
    if mask_error(views, bound):
        return (f"beyond the bound {bound:g}: {worst}; the float64 replay misses the sampler too ({wide['max_abs_diff']:.3g}, "
                f"float32 rounding is {wide['rounding']:.3g}): the replay is not what the sampler attended to, a mask or KV "
                "error (does the policy only drop entries, and does the rollout record all it dropped?)")
    return (f"beyond the bound {bound:g}: {worst}; the float64 replay is within float32 rounding of the sampler "
            f"({wide['max_abs_diff']:.3g}, rounding {wide['rounding']:.3g}): rounding, not a mask error (raise the bound)")
