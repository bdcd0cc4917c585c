"""The rollout's attention: attend, let the policy evict from the layer's cache, record the shadow mask.

Called by the model's attention (`smd_cli.attention.dispatch`) for every forward given `rollout_state=`, a
`RolloutState` for one batch of rows. It builds no [P, P] mask: the 2-D padding mask is folded into the
state (`key_real`), and slots are masked by validity.

Prefill (the whole padded prompt, one layer at a time): causal attention through the mask-free causal
kernel (`kernels.causal`; a prompt that several rows repeat, GRPO's G samples, runs once and its keys and
values are handed to each of its rows), then the policy scores what it needs (SnapKV only the
observation-window rows, H2O column sums in chunks): once a distinct prompt when its choice depends on the prompt
alone (`prefill_per_prompt`), else per row (a random policy still draws for every row), and the kept entries are
copied into that layer's `EvictingLayer` before the next layer runs: the full prompt KV of only one layer is ever
alive. Decode (one token): attention over the valid slots with each KV head's query group folded into the query axis (`kernels.grouped`: no copy of K
or V); decode-time policies then update their slot scores and evict. Every eviction after the query at
column `i` has attended sets `evict_at[b, l, h, j] = i + 1` (prompt entries dropped at prefill get `P`).
With an 8-bit cache (`kv.quant`) the prefill attends to the fresh keys and values (as vLLM's prefill does) and the
policy scores them; every decode step, and H2O's scores there, read the cache's dequantised ones (what a real quantised
cache shows), and the cache records each element's rounding direction in `rounding` (`smd_cli.attention.kv_quant`).

A decode step never reads the device from the host: the column comes as the cache's device tensor, entry
counts are summed on the device (`entries`, one total per forward), and slot scores are updated in place.
Which kernels it runs depends on the step only through `policy.decode_signature(step)`, so the rollout can
capture it as a CUDA graph (`smd_cli.rollout.sampler`); the visibility log (tests, debugging) is eager only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smd_cli.attention import kernels, kv_quant
from smd_cli.attention.kv_cache import FREE, EvictingCache
from smd_cli.attention.policy import EvictionPolicy, PrefillView, Selection
from smd_cli.attention.shadow import NEVER


@dataclass
class RolloutState:
    """What the rollout attention needs and what it records, for one batch of rows."""

    policy: EvictionPolicy
    cache: EvictingCache
    key_real: torch.Tensor  # [N, P] bool: real prompt tokens
    budget: torch.Tensor  # [N] kept prompt entries per row
    first_real: torch.Tensor  # [N] column of each row's first real token
    evict_at: torch.Tensor  # [N, L, Hkv, P + Rmax + 1] int32; the last column collects writes to nowhere
    visibility: torch.Tensor | None  # [N, L, Hkv, P + Rmax, P + Rmax] bool when recording
    entries: torch.Tensor  # [Rmax] long: entries attended at each forward (0 = prefill), summed over rows, layers, KV heads
    groups: tuple | None = None  # (first [U], owner [N]): the prefill runs the distinct prompts, the policy every row
    rounding: torch.Tensor | None = None  # [N, L, 2, Hkv, P + Rmax, D / 8] uint8: an 8-bit cache's rounding directions

    @classmethod
    def start(cls, config, policy, cache, prompt_mask, max_new_tokens: int, record_visibility: bool, groups=None) -> "RolloutState":
        rows, prompt_width = prompt_mask.shape
        layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
        width = prompt_width + max_new_tokens
        device = prompt_mask.device
        lengths = prompt_mask.sum(dim=-1)
        evict_at = torch.full((rows, layers, kv_heads, width + 1), NEVER, dtype=torch.int32, device=device)
        visibility = torch.zeros(rows, layers, kv_heads, width, width, dtype=torch.bool, device=device) if record_visibility else None
        entries = torch.zeros(max_new_tokens, dtype=torch.long, device=device)
        rounding = None
        if cache.layers[0].quant != "none":  # the cache writes each quantised entry's rounding directions here (`smd_cli.attention.kv_quant`)
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            rounding = torch.zeros(rows, layers, 2, kv_heads, width, kv_quant.packed_width(head_dim), dtype=torch.uint8, device=device)
            for layer, slots in enumerate(cache.layers):
                slots.rounding = rounding[:, layer]
        return cls(policy, cache, prompt_mask.bool(), policy.budget(lengths), prompt_width - lengths, evict_at, visibility, entries, groups,
                   rounding)

    @property
    def prompt_width(self) -> int:
        return self.key_real.shape[1]

    def finish(self, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shadow mask [N, L, Hkv, T] for the final width T: padding 0, never evicted T.

        Forwards run past the rollout's last step (the rollout checks for the end every few steps only) leave
        nothing behind: what they evicted gets a time > T, clamped to T (never evicted within T), and the one
        query row of theirs inside T, the last sampled token's, is cleared (the rollout never feeds it)."""
        width = attention_mask.shape[1]
        evict_at = self.evict_at[..., :width].clamp(max=width)  # one copy, contiguous
        evict_at.masked_fill_(~attention_mask.bool()[:, None, None, :], 0)
        visibility = None
        if self.visibility is not None:
            visibility = self.visibility[..., :width, :width]
            visibility[..., width - 1, :] = False
        return evict_at, visibility

    def entries_peak(self, forwards: int) -> int:
        """Most entries attended by one forward among the first `forwards` (reads the device)."""
        return int(self.entries[:forwards].max())


def _prefill(layer: int, query, key, value, scaling, state: RolloutState):
    width = state.prompt_width
    if state.groups is None:
        out = kernels.causal(query, key, value, scaling, state.first_real, widen=False)
        chosen = state.policy.select_prefill(PrefillView(query, key, state.key_real, scaling, layer), state.budget)
    else:  # the distinct prompts attend once; the policy chooses once a prompt where it can, else per row as without repeats
        first, owner = state.groups
        out = kernels.causal(query, key, value, scaling, state.first_real[first], widen=False)
        if state.policy.prefill_per_prompt:
            once = state.policy.select_prefill(PrefillView(query, key, state.key_real[first], scaling, layer), state.budget[first])
            chosen = Selection(once.index[owner], once.ok[owner], once.scores[owner])
        else:
            chosen = state.policy.select_prefill(PrefillView(query[owner], key[owner], state.key_real, scaling, layer), state.budget)
        key, value = key[owner], value[owner]
    state.cache.layers[layer].fill(key, value, chosen.index, chosen.ok, chosen.scores)
    target = torch.where(chosen.ok, chosen.index, width)  # padding of short rows goes to a spare column
    kept = torch.zeros(key.shape[:2] + (width + 1,), dtype=torch.bool, device=key.device).scatter_(-1, target, True)[..., :width]  # [N, Hkv, P]
    real = state.key_real[:, None, :].expand_as(kept)
    state.evict_at[:, layer, :, :width] = torch.where(real & ~kept, width, torch.where(real, NEVER, 0)).to(torch.int32)
    if state.visibility is not None:
        state.visibility[:, layer, :, :width, :width] = PrefillView(query, key, state.key_real, scaling, layer).mask()
    state.entries[:1].add_(chosen.ok.sum())
    return out


def _decode(layer: int, query, key, value, scaling, state: RolloutState):
    cache = state.cache
    column = cache.column_tensor  # [] long, on the device (the Python `cache.column` only for the eager log)
    slots = cache.layers[layer]
    valid = slots.valid()  # [N, Hkv, S]
    out = kernels.grouped(query, key, value, valid[:, :, None, :], scaling)
    if state.visibility is not None:
        width = state.visibility.shape[-1]
        seen = torch.zeros(valid.shape[:2] + (width + 1,), dtype=torch.bool, device=valid.device)
        seen.scatter_(-1, torch.where(valid, slots.columns, width).long(), True)
        state.visibility[:, layer, :, cache.column] = seen[..., :width]
    forward = (column - (state.prompt_width - 1)).view(1)  # the forward feeding `column`: column - P + 1
    state.entries.index_add_(0, forward, valid.sum().view(1))
    policy = state.policy
    step = cache.column - state.prompt_width
    if policy.decode_time:
        probs = kernels.grouped_probs(query, key, valid[:, :, None, :], scaling)  # [N, H, 1, S]
        received = probs.view(key.shape[0], key.shape[1], -1, probs.shape[-1]).sum(dim=2)  # summed over each query group
        slots.scores.copy_(policy.decode_scores(slots.scores, received.masked_fill(~valid, 0.0), step))  # in place
    if policy.evicts_after(step):
        evict = policy.select_decode(slots.scores, slots.columns, state.budget, column, state.first_real)
        evicted = slots.evict(evict)  # [N, Hkv, S] columns, FREE where nothing left
        nowhere = state.evict_at.shape[-1] - 1
        target = torch.where(evicted != FREE, evicted, nowhere).long()
        state.evict_at[:, layer].scatter_(-1, target, (column + 1).to(state.evict_at.dtype).expand(target.shape))
    return out


def rollout_attention(layer: int, query, key, value, scaling: float, state: RolloutState) -> torch.Tensor:
    """Attention of the evicting rollout at layer `layer`: [N, H, q, D]."""
    if query.shape[2] > 1:
        return _prefill(layer, query, key, value, scaling, state)
    return _decode(layer, query, key, value, scaling, state)
