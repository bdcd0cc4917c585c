"""The question outside the compressed span: a policy compresses the context alone, the prompt's closing is kept.

kvpress's evaluation (its pipeline, unless `query_aware`) prefills the context under the press and appends the
question afterwards, uncompressed; this project's rollouts compress the whole prompt, question included, so a
query-aware policy (SnapKV) sees the question in its observation window. `ContextOnly(inner, closing)` gives the
first setting inside our sampler: row r's last `closing[r]` prompt tokens (a RULER prompt's question, the
template's end and the answer prefix: `Ruler.closing_tokens`) are all kept, outside the budget, and `inner` chooses
among the tokens before them as if the prompt ended there. In the causal prefill the context's queries never see
the closing, so its observation window holds the context's last queries, as kvpress's does. Prompts are
left-padded, so the closing is the last `closing[r]` columns of every row. Decoding is `inner`'s.
"""

from __future__ import annotations

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView, Selection


class ContextOnly(EvictionPolicy):
    """`inner`'s choice over each row's context; the row's last `closing[r]` tokens always kept, beyond the budget."""

    def __init__(self, inner: EvictionPolicy, closing: list[int]):
        if any(t < 0 for t in closing) or not closing:
            raise ValueError(f"closing must list one length >= 0 per row, got {closing}")
        self.inner, self.closing = inner, torch.tensor(closing)
        self.compression, self.sink, self.window = inner.compression, inner.sink, inner.window
        self.decode_time = inner.decode_time

    def budget(self, prompt_lengths: torch.Tensor) -> torch.Tensor:
        closing = self.closing.to(prompt_lengths.device)
        if bool((closing >= prompt_lengths).any()):
            raise ValueError(f"a row's closing ({self.closing.tolist()}) leaves no context in its prompt ({prompt_lengths.tolist()})")
        return self.inner.budget(prompt_lengths - closing) + closing

    def select_prefill(self, view: PrefillView, budget: torch.Tensor) -> Selection:
        width, heads = view.key.shape[2], view.key.shape[1]
        closing = self.closing.to(view.key.device)
        parts = []
        for t in closing.unique().tolist():
            rows = torch.nonzero(closing == t).flatten()
            cut = width - t
            chosen = self.inner.select_prefill(view.subset(rows, cut), budget[rows] - t)
            tail = torch.arange(cut, width, device=view.key.device).expand(len(rows), heads, t)
            index = torch.cat([chosen.index, tail], dim=-1)
            ok = torch.cat([chosen.ok, torch.ones_like(tail, dtype=torch.bool)], dim=-1)
            scores = torch.cat([chosen.scores, torch.full(tail.shape, float("inf"), device=view.key.device)], dim=-1)
            order = torch.where(ok, index, width).argsort(dim=-1, stable=True)  # by position, the padding last
            parts.append((rows, Selection(index.gather(-1, order), ok.gather(-1, order), scores.gather(-1, order))))
        return Selection.merge(view.key.shape[0], parts)

    # decoding is the inner policy's
    def decode_scores(self, slot_scores, attention, step):
        return self.inner.decode_scores(slot_scores, attention, step)

    def evicts_after(self, step: int) -> bool:
        return self.inner.evicts_after(step)

    def decode_signature(self, step: int):
        return self.inner.decode_signature(step)

    def cache_growth(self, decode_steps: int) -> int:
        return self.inner.cache_growth(decode_steps)

    def select_decode(self, slot_scores, slot_columns, budget, column, first_real):
        return self.inner.select_decode(slot_scores, slot_columns, budget, column, first_real)
