"""The sampling support of top-k / top-p, recorded as one number per token and replayed exactly by the learner.

With `top_k > 0` or `top_p < 1` the rollout draws from the truncated, renormalised distribution
`q(v) = p(v) 1[v in S] / sum_{u in S} p(u)`, so that is the policy whose log-probs it records, and the learner
must score the same support S ("Keep Sampling Mask", DeepSeek-V3.2, arXiv 2512.02556; vLLM PR 49577; prime-rl
PR 3431). S is recorded as one float32 per token, the cut `c`: S = {v : log p(v) >= c}, with `log p` the
full-vocabulary `log_softmax(logits / T)` (T = 0, greedy, counts as 1) computed in float32.

How the cut makes the rebuild exact:
- The support is decided by value, not by position in a sort: top-k keeps every token whose log-prob is at least
  the k-th largest, ties included (as transformers' top-k does); top-p finds the last position of the sorted
  distribution it needs, then also keeps every token tied with it. So S is always {log p >= a} for the
  smallest kept value a, and no tie is ever split between kept and dropped.
- The cut lies strictly between a and b, the largest dropped value: their float32 midpoint when it is above b,
  else a itself (a and b adjacent floats). The sampler's own log-probs then give back S exactly, and a learner
  whose log-probs differ from the sampler's by rounding keeps the same tokens unless the gap a - b is itself
  of that size.
- The top-p sum (the cumulative mass compared with top_p, in float32) is computed once, by the sampler: the
  learner never recomputes it, so its own rounding of that sum cannot move the support.
- The token drawn always counts as inside (`restrict`), so the learner's log-prob of it is finite even in the
  degenerate case where rounding moves it across a zero-margin cut.
Every view of the learner keeps the tokens it finds at least as probable as the cut: for the sampler's own view
(the shadow replay, or a dense learner of a dense rollout) that is exactly S; a dense learner of an evicting
rollout gets its own support at the sampler's probability threshold.
"""

from __future__ import annotations

import torch

OUTSIDE = -1.0e30  # the log-prob given to tokens outside the support: exp() takes it to 0, no product turns NaN


def support_cut(logp: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor | None:
    """The cut [N] of the support of top-k then top-p (on the top-k renormalised rest, as transformers and vLLM
    order them) over full-vocabulary log-probs `logp` [N, V]; None when nothing is truncated."""
    vocab = logp.shape[-1]
    by_k = 0 < top_k < vocab
    if not by_k and top_p >= 1.0:
        return None
    if top_p >= 1.0:  # top-k alone: no sort of the vocabulary
        smallest = logp.topk(top_k, dim=-1).values[:, -1]  # [N]
    else:
        ordered = logp.sort(dim=-1, descending=True).values  # [N, V]
        probs = ordered.exp()
        if by_k:
            probs = probs.masked_fill(ordered < ordered[:, top_k - 1 : top_k], 0.0)
        before = probs.cumsum(dim=-1) - probs  # mass ahead of each position
        limit = top_p * probs.sum(dim=-1, keepdim=True) if by_k else top_p
        needed = before < limit  # a prefix of the sorted positions; the top token always
        smallest = ordered.gather(-1, (needed.sum(dim=-1, keepdim=True) - 1).clamp(min=0)).squeeze(-1)
    dropped = logp.masked_fill(logp >= smallest[:, None], float("-inf")).amax(dim=-1)  # [N] largest value left out
    middle = (smallest + dropped) * 0.5
    return torch.where(middle > dropped, middle, smallest)


def outside(logp: torch.Tensor, cut: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, V] bool: the tokens outside the support {log p >= cut} (logp [n, V], cut [n]), the drawn `tokens` [n]
    always inside."""
    return (logp < cut[:, None]).scatter(-1, tokens[:, None], False)


def restrict(logp: torch.Tensor, cut: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary log-probs [n, V] with every token outside the support set to OUTSIDE: a logsumexp over it
    is the log of the support's mass, and `restrict(...) - logsumexp` the truncated distribution's log-probs."""
    return logp.masked_fill(outside(logp, cut, tokens), OUTSIDE)


def truncated_logprob(logp: torch.Tensor, cut: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log q(token) [n]: the log-prob of `tokens` under the distribution renormalised over the support."""
    kept = restrict(logp, cut, tokens)
    return kept.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(kept, dim=-1)
