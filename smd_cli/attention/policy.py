"""The shared base of every eviction policy: budgets, protected entries, top-k selection.

A policy only scores (the kvpress `KnormPress` shape): `prefill_scores` says how much each prompt entry
deserves to stay, per (row, KV head); this base turns scores into kept entries under the budget of
DESIGN.md section 2, `k = clamp(ceil((1 - c) * P), min = sink + window, max = P)` per row, always keeping
the first `sink` real tokens and the newest `window` ones. Decode-time policies (H2O) also override
`decode_scores`, and the base then evicts one entry per step whenever a (row, KV head) holds more than its
budget. Policies never see slots or caches beyond the tensors handed to them, and never re-run in the
learner: the rollout records what they chose (the shadow mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from smd_cli.attention import kernels


@dataclass
class PrefillView:
    """One layer's attention at prefill, as a policy may inspect it (scores are computed on demand, for
    the rows asked for, in the compute dtype and without expanding K to the query heads)."""

    query: torch.Tensor  # [B, H, P, D], RoPE applied
    key: torch.Tensor  # [B, Hkv, P, D], RoPE applied
    key_real: torch.Tensor  # [B, P] bool: real (non-padding) prompt tokens
    scaling: float
    layer_idx: int

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    def mask(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Prefill visibility of query rows [start, stop): causal, padding keys hidden, a padding query sees
        itself. [B, 1, q, P] bool."""
        width = self.key.shape[2]
        rows = torch.arange(width, device=self.key.device)[start:stop, None]  # [q, 1]
        columns = torch.arange(width, device=self.key.device)
        return ((columns <= rows) & self.key_real[:, None, None, :]) | (columns == rows)

    def attention(self, start: int, stop: int | None = None) -> torch.Tensor:
        """Attention probabilities of query rows [start, stop) over the whole prompt: [B, H, q, P] float32."""
        return kernels.grouped_probs(self.query[:, :, start:stop], self.key, self.mask(start, stop), self.scaling)

    def attention_received(self, chunk: int | None = None) -> torch.Tensor:
        """Attention each key receives, summed over all query rows, `chunk` rows at a time: [B, H, P].

        By default a chunk holds about 2^26 probabilities (256 MiB in float32), whatever the batch."""
        batch, heads, prompt_width = self.query.shape[:3]
        chunk = chunk or max(1, (1 << 26) // (batch * heads * prompt_width))
        total = torch.zeros(batch, heads, prompt_width, device=self.query.device)
        for start in range(0, prompt_width, chunk):
            total += self.attention(start, start + chunk).sum(dim=2)
        return total

    def subset(self, rows: torch.Tensor, stop: int | None = None) -> PrefillView:
        """The view of rows `rows` and prompt columns [0, stop), as if those rows' prompts ended there."""
        return PrefillView(self.query[rows, :, :stop], self.key[rows, :, :stop], self.key_real[rows, :stop], self.scaling,
                           self.layer_idx)

    def per_kv_head(self, scores: torch.Tensor) -> torch.Tensor:
        """Mean over each KV head's query group (GQA): [B, H, P] -> [B, Hkv, P]."""
        batch, heads, width = scores.shape
        return scores.view(batch, heads // self.groups, self.groups, width).mean(dim=2)


@dataclass
class Selection:
    """Kept prompt entries of one layer, sorted by position; `ok` is False on the padding of short rows."""

    index: torch.Tensor  # [B, Hkv, K] long: prompt columns kept
    ok: torch.Tensor  # [B, Hkv, K] bool
    scores: torch.Tensor  # [B, Hkv, K] float32: the policy's score of each kept entry

    @staticmethod
    def merge(batch: int, parts: list[tuple[torch.Tensor, Selection]]) -> Selection:
        """One Selection of `batch` rows from the Selections of row subsets, `(rows, selection)`; K is the widest
        part's, the others padded (index 0, ok False, score 0)."""
        first = parts[0][1].index
        shape = (batch, first.shape[1], max(s.index.shape[-1] for _, s in parts))
        index = torch.zeros(shape, dtype=torch.long, device=first.device)
        ok = torch.zeros(shape, dtype=torch.bool, device=first.device)
        scores = torch.zeros(shape, dtype=torch.float32, device=first.device)
        for rows, s in parts:
            k = s.index.shape[-1]
            index[rows, :, :k], ok[rows, :, :k], scores[rows, :, :k] = s.index, s.ok, s.scores
        return Selection(index=index, ok=ok, scores=scores)


class EvictionPolicy:
    """Base class: decide per (layer, KV head) which KV entries to drop. Subclasses implement the scores."""

    decode_time: bool = False  # True for policies that also evict while generating
    # True for policies whose prefill choice is a function of the prompt alone (no random draw): the rows that repeat a
    # prompt (GRPO's G samples) then get one choice, computed once per distinct prompt (H2O's full attention map at
    # 1024 tokens was most of its rollout when scored for every row). False (the default) scores every row.
    prefill_per_prompt: bool = False

    def __init__(self, compression: float = 0.5, sink: int = 4, window: int = 16):
        if not 0.0 <= compression < 1.0:
            raise ValueError(f"compression must be in [0, 1) (fraction of prompt KV evicted), got {compression}")
        if sink < 0 or window < 0:
            raise ValueError(f"sink and window must be >= 0, got sink={sink}, window={window}")
        self.compression, self.sink, self.window = float(compression), int(sink), int(window)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "decode_time")
        return f"{type(self).__name__}({fields})"

    def state_dict(self) -> dict:
        """The policy's own random state, saved with checkpoints so that a resumed run evicts exactly what an
        uninterrupted one would (tensors and plain types only). Deterministic policies have none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but a checkpoint holds {sorted(state)}")

    # -- what a policy implements ------------------------------------------------------------------
    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        """Score of each prompt entry, higher = keep: [B, Hkv, P]."""
        raise NotImplementedError

    def decode_scores(self, slot_scores: torch.Tensor, attention: torch.Tensor, step: int) -> torch.Tensor:
        """Decode-time policies: new per-slot scores [B, Hkv, S] from the old ones and the attention that
        decode step `step` (0 = the first generated token is fed) paid to each slot."""
        raise NotImplementedError(f"{type(self).__name__} does not evict while decoding")

    def evicts_after(self, step: int) -> bool:
        """Whether decode step `step` ends with an eviction (every step for H2O)."""
        return self.decode_time

    def decode_signature(self, step: int) -> tuple | None:
        """What of decode step `step`'s work depends on `step` beyond tensors: two steps with equal signatures
        run the same kernels on the same tensors (the column being decoded is a device tensor), so one CUDA
        graph captured at one of them replays the other. None = not known to be so (decoded eagerly): the
        default for decode-time policies, whose `decode_scores` may branch on `step`; a policy that knows
        its branches overrides it (H2O, SnapKV)."""
        return () if not self.decode_time else None

    def cache_growth(self, decode_steps: int) -> int:
        """Slots beyond the prompt budget that the cache needs for `decode_steps` fed tokens (the last
        sampled token is never fed): all of them, or one at a time when evicting while decoding."""
        return 1 if self.decode_time else decode_steps

    # -- shared bookkeeping ------------------------------------------------------------------------
    def budget(self, prompt_lengths: torch.Tensor) -> torch.Tensor:
        """Kept prompt entries per row: clamp(ceil((1 - c) * P), sink + window, P). [B] long."""
        keep = torch.tensor([math.ceil((1.0 - self.compression) * int(p)) for p in prompt_lengths])
        keep = keep.clamp(min=self.sink + self.window)
        return torch.minimum(keep, prompt_lengths.cpu()).to(prompt_lengths.device)

    def protected_prompt(self, key_real: torch.Tensor) -> torch.Tensor:
        """The first `sink` and the newest `window` real prompt tokens of each row: [B, P] bool."""
        rank = key_real.long().cumsum(dim=-1) - 1  # [B, P] index among real tokens
        from_end = key_real.long().sum(dim=-1, keepdim=True) - 1 - rank
        return key_real & ((rank < self.sink) | (from_end < self.window))

    def select_prefill(self, view: PrefillView, budget: torch.Tensor) -> Selection:
        """Top-`budget` entries per (row, KV head) by score, protected ones first, sorted by position."""
        raw = self.prefill_scores(view).float()  # [B, Hkv, P]
        ranked = raw.masked_fill(self.protected_prompt(view.key_real)[:, None], float("inf"))
        ranked = ranked.masked_fill(~view.key_real[:, None], float("-inf"))
        width = int(budget.max())
        top = ranked.topk(width, dim=-1).indices  # [B, Hkv, K]
        in_budget = torch.arange(width, device=top.device) < budget[:, None, None]
        prompt_width = raw.shape[-1]
        index, _ = torch.where(in_budget, top, prompt_width).sort(dim=-1)
        ok = index < prompt_width
        index = index.clamp(max=prompt_width - 1)
        return Selection(index=index, ok=ok, scores=raw.gather(-1, index))

    def select_decode(
        self,
        slot_scores: torch.Tensor,
        slot_columns: torch.Tensor,
        budget: torch.Tensor,
        column: int | torch.Tensor,
        first_real: torch.Tensor,
    ) -> torch.Tensor:
        """Slots to evict after the step at `column` (an int or a [] tensor on the device): in every (row, KV
        head) holding more than its budget, the lowest-scoring entries outside the newest `window` and the
        `sink` first, down to the budget. slot_columns [B, Hkv, S] (-1 = free). Returns [B, Hkv, S] bool."""
        valid = slot_columns >= 0
        excess = (valid.sum(dim=-1) - budget[:, None]).clamp(min=0)  # [B, Hkv]
        recent = slot_columns > column - self.window
        sinks = slot_columns < (first_real + self.sink)[:, None, None]
        candidates = valid & ~recent & ~sinks
        order = slot_scores.masked_fill(~candidates, float("inf")).argsort(dim=-1, stable=True)  # lowest first
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
        return candidates & (rank < excess[..., None])
