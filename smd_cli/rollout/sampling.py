"""The sampling support of top-k / top-p, recorded as the kept token set itself, and the one log-prob formula that
the sampler and every learner view share.

With `top_k > 0` or `top_p < 1` the rollout draws from the truncated, renormalised distribution
`q(v) = p(v) 1[v in S] / sum_{u in S} p(u)`, so that is the policy whose log-probs it records, and every view of the
learner must score the same set S ("Keep Sampling Mask", DeepSeek-V3.2, arXiv 2512.02556; vLLM PR 49577 returns it
as CSR token ids + offsets; prime-rl PR 3431). Only the sampler's own logits can rebuild S from a probability
threshold: a view with other logits (the dense learner of an evicting rollout, SMD's dense teacher) would keep
another set there, down to the drawn token alone (log-prob 0, no gradient). So S itself is recorded (`Support`):
the kept token ids of every response token one after another, `ids` [M] int32, with each token's `start` [N, R]
and `count` [N, R] in it: 4 bytes per kept token, plus 12 per response token.

The bound, MAX_SUPPORT = 512 tokens per step (prime-rl's cap on top_k): a `top_k` above it is refused (a config
error); a top-p support that would need more (a flat distribution with top_p near 1) is cut to the MAX_SUPPORT most
probable tokens. The sampler draws from that capped set, records it, and the learner scores it, so the two still
agree; the rollout counts such tokens (`rollout/support_capped_fraction`) and warns once.

How S is chosen (`choose`), from the full-vocabulary log-probs: top-k keeps every token at least as probable as the
k-th (ties included, as transformers' top-k), then top-p works on the top-k renormalised rest (as transformers and
vLLM order them): the shortest prefix of the sorted distribution whose mass reaches top_p, and every token tied
with its last one. Only tokens inside top-k count towards that prefix, so a top_p within rounding of 1 keeps the
top-k set, never more (a float32 cumulative sum over the zeroed tail once stayed below `top_p * mass` and took in
the whole vocabulary). The drawn token always counts as inside (`inside`).

The log-prob (`logprob`): `logit - logsumexp(logits)` over the support (the logits divided by the temperature,
float32 or float64, tokens outside set to OUTSIDE), computed by this one function for the sampler and for every
learner view, so that the two differ only by their forwards, never by two roundings of one normalisation (the
sampler's float32 `log_softmax` against the learner's `logit - logsumexp` was 2-3e-5 apart on SmolLM2's 49152
tokens, above the 1e-5 bound of DESIGN.md contract 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from smd_cli.options import MAX_SUPPORT

OUTSIDE = -1.0e30  # the logit given to tokens outside the support: exp() takes it to 0, no product turns NaN


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits / T in float32 (float64 kept: the float64 parity replay); T = 0 (greedy) and 1 leave them as they are."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return logits if temperature in (0, 1) else logits / temperature


def logprob(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob [n] of `tokens` [n], log-partition [n]) under `scaled` logits [n, V] (OUTSIDE beyond a support): the
    formula shared by the sampler and the learner, `logit - logsumexp`."""
    log_z = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - log_z, log_z


class Kept(NamedTuple):
    """One step's support per row: `ids` [N, W] by decreasing probability, the first `count` [N] kept; `capped` [N]
    whether the support reached the bound MAX_SUPPORT (top-p wanted more, or ties)."""

    ids: torch.Tensor
    count: torch.Tensor
    capped: torch.Tensor


def choose(logp: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> Kept | None:
    """The support of top-k then top-p over full-vocabulary log-probs `logp` [N, V] (the module's rule; top_k at most
    MAX_SUPPORT, which `generate` checks), at most MAX_SUPPORT tokens; None when nothing is truncated."""
    vocab = logp.shape[-1]
    by_k = 0 < top_k < vocab
    if not by_k and top_p >= 1.0:
        return None
    width = min(vocab, MAX_SUPPORT)
    values, ids = logp.topk(width, dim=-1)  # [N, W], sorted
    allowed = values >= values[:, top_k - 1 : top_k] if by_k else torch.ones_like(values, dtype=torch.bool)
    inside = allowed
    if top_p < 1.0:
        probs = values.exp().masked_fill(~allowed, 0.0)
        before = probs.cumsum(dim=-1) - probs  # mass ahead of each position
        limit = top_p * probs.sum(dim=-1, keepdim=True) if by_k else top_p
        needed = (before < limit) & allowed  # a prefix of the top-k positions; the top token always
        smallest = values.gather(-1, (needed.sum(dim=-1, keepdim=True) - 1).clamp(min=0))  # NaN logits: the rollout raises
        inside = values >= smallest  # ties with the last one needed come along
    count = inside.sum(dim=-1)
    return Kept(ids, count, (count >= width) & (width < vocab))


def kept_mask(kept: Kept, vocab: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] bool: the tokens of one step's support (and `tokens` [N], the drawn ones, when given)."""
    slots = torch.arange(kept.ids.shape[-1], device=kept.ids.device)
    ids = torch.where(slots < kept.count[:, None], kept.ids, kept.ids[:, :1])  # unused slots repeat the top token
    mask = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device).scatter_(-1, ids, True)
    return mask if tokens is None else mask.scatter_(-1, tokens[:, None], True)


@dataclass
class Support:
    """The kept token sets of a batch of responses [N, R]: token (n, r) kept `ids[start[n, r] : start[n, r] +
    count[n, r]]` (count 0 where there is no response token). `width` is the largest count."""

    ids: torch.Tensor  # [M] int32
    start: torch.Tensor  # [N, R] int64
    count: torch.Tensor  # [N, R] int32
    width: int

    def rows(self, rows) -> "Support":
        """The support of some rows (the ids are shared, not copied)."""
        return Support(self.ids, self.start[rows], self.count[rows], self.width)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What `smd rollout` saves: `sampling_support_{ids,start,count}`."""
        return {"sampling_support_ids": self.ids, "sampling_support_start": self.start, "sampling_support_count": self.count}


def inside(ids: torch.Tensor, start: torch.Tensor, count: torch.Tensor, tokens: torch.Tensor, vocab: int, width: int) -> torch.Tensor:
    """[n, V] bool: each token's support (`Support` fields flattened to [n]: `start`, `count`) and the drawn `tokens`
    [n] always inside. Gathers [n, width] ids, never more."""
    slots = torch.arange(width, device=tokens.device)
    where = (start[:, None] + slots).clamp(max=max(ids.numel() - 1, 0))  # [n, width]
    found = ids[where].long() if ids.numel() else tokens[:, None].expand(-1, width)
    chosen = torch.where(slots < count[:, None], found, tokens[:, None])  # unused slots point at the drawn token
    mask = torch.zeros(tokens.shape[0], vocab, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(-1, chosen, True).scatter_(-1, tokens[:, None], True)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, support: Support | None = None) -> torch.Tensor:
    """`logprob` of `tokens` [B, R] under logits [B, R, V] that already exist (small models, the physical learner):
    [B, R], over each token's recorded `support` when given (temperature 0, greedy, counts as 1). The learner
    scores through `smd_cli.learner.forward.vocab_terms`, which never holds [B, R, V]."""
    vocab = logits.shape[-1]
    flat, flat_tokens = scaled(logits, temperature).reshape(-1, vocab), tokens.long().reshape(-1)
    if support is not None:
        kept = inside(support.ids, support.start.reshape(-1), support.count.reshape(-1), flat_tokens, vocab, support.width)
        flat = flat.masked_fill(~kept, OUTSIDE)
    return logprob(flat, flat_tokens)[0].view(tokens.shape)


class SupportLog:
    """A rollout's supports as it decodes: each step's `Kept` waits on the device and is packed into `Support`'s
    layout at the rollout's periodic host read (`flush`), so the decode loop reads nothing at a step; the waiting
    part is [N, sync_every, W] int32."""

    def __init__(self, rows: int, steps: int, device):
        self.start = torch.zeros(rows, steps, dtype=torch.long, device=device)
        self.count = torch.zeros(rows, steps, dtype=torch.int32, device=device)
        self.capped = torch.zeros((), dtype=torch.long, device=device)
        self.pieces: list[torch.Tensor] = []
        self.waiting: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.size = 0

    def add(self, step: int, kept: Kept, live: torch.Tensor) -> None:
        count = torch.where(live, kept.count, 0).int()  # a finished row decodes padding: nothing kept
        self.count[:, step] = count
        self.capped += (kept.capped & live).sum()
        self.waiting.append((step, kept.ids.int(), count))

    def flush(self) -> None:
        if not self.waiting:
            return
        first = self.waiting[0][0]
        ids = torch.stack([w[1] for w in self.waiting], 1)  # [N, s, W]
        count = torch.stack([w[2] for w in self.waiting], 1)  # [N, s]
        slots = torch.arange(ids.shape[-1], device=ids.device)
        packed = ids[slots < count[..., None]]  # row by row, step by step
        flat = count.reshape(-1).long()
        self.start[:, first : first + count.shape[1]] = (self.size + flat.cumsum(0) - flat).view(count.shape)
        self.pieces.append(packed)
        self.size += packed.numel()
        self.waiting.clear()

    def support(self, steps: int) -> tuple[Support, dict[str, float]]:
        """The `Support` of the first `steps` steps, and its statistics: kept tokens per response token, and the
        fraction of response tokens whose support reached MAX_SUPPORT."""
        self.flush()
        ids = torch.cat(self.pieces) if self.pieces else self.count.new_zeros(0)
        count = self.count[:, :steps]
        tokens = max(int((count > 0).sum()), 1)
        stats = {"rollout/support_size_mean": self.size / tokens, "rollout/support_capped_fraction": int(self.capped) / tokens}
        return Support(ids, self.start[:, :steps], count, int(count.max()) if count.numel() else 0), stats
