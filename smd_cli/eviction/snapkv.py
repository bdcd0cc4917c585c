"""SnapKV (Li et al. 2024): the last `window` prompt queries (the observation window) vote for the keys
they attend; votes are pooled along positions and averaged over each KV head's query group (GQA), and
each KV head keeps its own top entries plus the window.

With `recompress_every = N > 0` it also compresses while decoding, as Sparse-RL's rollouts do: the cache
grows for N steps, the attention of the last `window` of those steps' queries is summed per slot, and the
cache is cut back to the prompt budget (pooling is skipped there: slots are not ordered by position).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smd_cli.attention.policy import EvictionPolicy, PrefillView


class SnapKV(EvictionPolicy):
    """Observation-window attention, summed over the window, average-pooled with `kernel`."""

    prefill_per_prompt = True

    def __init__(self, compression: float = 0.5, sink: int = 4, window: int = 16, kernel: int = 5, recompress_every: int = 0):
        super().__init__(compression, sink, window)
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, got {kernel}")
        if window < 1:
            raise ValueError(f"SnapKV needs an observation window >= 1, got window={window}")
        if recompress_every < 0 or 0 < recompress_every < window:
            raise ValueError(f"recompress_every must be 0 (off) or >= window ({window}), got {recompress_every}")
        self.kernel, self.recompress_every = int(kernel), int(recompress_every)
        self.decode_time = self.recompress_every > 0

    def prefill_scores(self, view: PrefillView) -> torch.Tensor:
        width = view.query.shape[2]
        votes = view.attention(max(width - self.window, 0)).sum(dim=2)  # [B, H, P]: window rows only
        pooled = F.avg_pool1d(votes, self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)
        return view.per_kv_head(pooled)  # [B, Hkv, P]

    def decode_scores(self, slot_scores: torch.Tensor, attention: torch.Tensor, step: int) -> torch.Tensor:
        phase = step % self.recompress_every
        first_vote = self.recompress_every - self.window
        if phase < first_vote:
            return slot_scores
        if phase == first_vote:
            slot_scores = torch.zeros_like(slot_scores)  # a new observation window starts
        return slot_scores + attention

    def decode_signature(self, step: int) -> tuple:
        if not self.decode_time:
            return ()
        phase, first_vote = step % self.recompress_every, self.recompress_every - self.window
        return (phase < first_vote, phase == first_vote, self.evicts_after(step))  # the branches `decode_scores` takes

    def evicts_after(self, step: int) -> bool:
        return self.decode_time and (step + 1) % self.recompress_every == 0

    def cache_growth(self, decode_steps: int) -> int:
        return min(self.recompress_every, decode_steps) if self.decode_time else decode_steps
