"""Per-token agreement between the sampler's next-token distribution and the dense full-context policy's.

Definition (Sparrow, arXiv 2606.08446; github Infini-AI-Lab/Sparrow, `sum_min_from_topk` in its verl fork): for
a response token t with the sampler's next-token distribution q_t and the dense policy's p_t at the same weights,

    a_t = sum_v min(p_t(v), q_t(v)) = 1 - TV(p_t, q_t) = 1 - ||p_t - q_t||_1 / 2,

in [0, 1]: 1 when the two are the same distribution, 0 when they share no token. It is the probability that
the dense policy and the sampler, coupled as well as two samplers can be, draw the same token (speculative
decoding's acceptance rate). Sparrow reads stability off its lower tail: the 5th percentile of a_t over a step's
tokens (`p5`), which it keeps at or above 0.86; the mean says little (its stable and collapsing budgets had means
of 0.977 and 0.968). Sparrow computes the sum over the two distributions' top-k sets (a lower bound); here it is
exact, over the whole vocabulary, in chunks of tokens like SMD's KL (`smd_cli.learner.forward._terms`): no [N, R, V]
tensor is ever held.

The two distributions, from what the learner has:
- q_t, the sampler's: the learner's shadow view (the rollout's evictions replayed by the shadow mask, and any
  other approximation the replay family of DESIGN.md contract 7 replays, e.g. a quantised cache), which equals
  the sampler's distribution within float rounding (contract 1);
- p_t, the dense policy's: the full-context forward at the same weights (SMD's teacher).
Under top-k / top-p both are taken over the sampler's recorded kept token set and renormalised there, as every
learner view scores it (`smd_cli.rollout.sampling`): the statistic measures what the cache changes, not the truncation,
which every view replays exactly. The temperature is the sampler's.

Where it comes from: SMD's learner step computes both views anyway (its shadow replay and its dense teacher), so
there it is free (`vocab_terms`' `agreement`). Every other view (a dense learner: naive_sparse, sparse_rl, tis, ...;
SMD with lambda = 0; `smd rollout`, `smd check-parity`) gets `measure`: one extra forward without gradient that
runs both views in one pass over the layers (`shadow_and_teacher_hidden`), at the rollout's weights.
"""

from __future__ import annotations

import torch

from smd_cli.learner.forward import shadow_and_teacher_hidden, vocab_terms
from smd_cli.runtime import distributed

PERCENTILES = (5, 50)  # logged as agreement/p5, agreement/p50 beside agreement/mean and agreement/min


def quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile (q in [0, 1]) of a 1-D tensor, linear interpolation between order statistics (numpy's default)."""
    ordered = values.double().flatten().sort().values
    if ordered.numel() == 0:
        return float("nan")
    position = q * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    return float(ordered[low] + (position - low) * (ordered[high] - ordered[low]))


def summary(values: torch.Tensor, prefix: str = "agreement/") -> dict[str, float]:
    """p5, p50, mean and min of per-token agreements [n] (every rank's tokens under torchrun)."""
    values = values.detach().double().flatten().cpu()
    if distributed.size() > 1:
        values = torch.tensor(sum(distributed.gather_objects(values.tolist()), []), dtype=torch.float64)
    if values.numel() == 0:
        return {}
    out = {f"{prefix}p{p}": quantile(values, p / 100) for p in PERCENTILES}
    out.update({f"{prefix}mean": float(values.mean()), f"{prefix}min": float(values.min())})
    return out


@torch.no_grad()
def measure(model, batch, temperature: float, chunk: int | None = None, micro_batch_size: int | None = None,
            backend: str = "auto") -> torch.Tensor | None:
    """Per real response token of `batch` (a `RolloutBatch`), the agreement between its shadow view (the sampler's
    distribution) and the dense view, [n] in row-major order of `response_mask`; None for a dense rollout (no
    shadow mask: the sampler's distribution is the dense one). `micro_batch_size` rows at a time."""
    if batch.evict_at is None:
        return None
    n, P = batch.input_ids.shape[0], batch.prompt_length
    step = micro_batch_size or n
    head, out = model.get_output_embeddings(), []
    reads = getattr(batch, "cache_reads", None)  # an 8-bit cache (`RolloutBatch.cache_reads`), replayed in the shadow view (DESIGN.md 7)
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        replayed = () if reads is None or reads(rows) is None else (reads(rows),)
        shadow, dense = shadow_and_teacher_hidden(model, batch.input_ids[rows], batch.attention_mask[rows], P, batch.evict_at[rows],
                                                  backend, *replayed)
        support = None if batch.sampling_support is None else batch.sampling_support.rows(rows)
        mask = batch.response_mask[rows]
        terms = vocab_terms(head, shadow, batch.input_ids[rows, P:], mask, temperature, dense, chunk, support)
        out.append(terms["agreement"][mask])
    return torch.cat(out)
