"""Attention kernels without quadratic masks or K/V copies (DESIGN.md section 6, "paper scale").

Three shapes of attention cover every forward of the project:

- `causal`: a full, left-padded sequence (prefill, the learner's prompt rows, the dense learner). Each row
  is rolled so that its left padding moves to the right end, where causal attention never lets a real
  token see it; SDPA then runs with `is_causal=True` and no mask at all (flash kernels on CUDA and CPU),
  and the output is rolled back. Costs one gather of Q, K, V and O: linear in T, never [T, T].
- `grouped`: queries against keys under a per-KV-head boolean mask (decode steps, the replay's response
  rows, the physical learner). Each KV head's group of G query heads is folded into the query axis, so
  K and V are used as they are (no `repeat_interleave`) and the mask needs no head expansion.
- `grouped_probs`: attention probabilities for eviction policies, computed the same folded way in the
  compute dtype (softmax in float32), for the rows a policy asks for.

Shapes: query [B, H, q, D], key/value [B, Hkv, S, D], H = G * Hkv with query head h reading KV head h // G
(the layout of transformers' GQA).

`widened(dtype)` runs `causal` and `grouped` in a wider dtype than their inputs' (`model.attention_dtype`): the
sampler's decode step and the learner's full-sequence replay sum the same scores in different orders, and in
float32 that difference, grown through SmolLM2's 30 layers, was 2.5e-6 of a log-prob on 4 rows (with `row_floor`); in
float64, the learner's log-probs were the sampler's bit for bit. A prompt's rows are the exception (`causal(...,
widen=False)`): the sampler's prefill and the learner's prompt rows run this same kernel on the same [rows, P] shape,
so their sums come in one order and need no widening; that is most of a long prompt's attention (a float64 prefill
took 1.35x a float32 one for SmolLM2 at 1024 tokens).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.nn.functional as F

_WIDE: ContextVar[torch.dtype | None] = ContextVar("smd_attention_dtype", default=None)


@contextlib.contextmanager
def widened(dtype: torch.dtype | None):
    """Within: `causal` and `grouped` cast query, key and value to `dtype` and their output back (None: as they come)."""
    token = _WIDE.set(dtype)
    try:
        yield
    finally:
        _WIDE.reset(token)


def widening(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype `causal` and `grouped` cast inputs of `dtype` to here, or None when they keep it: `widened` only
    widens (a float64 model's attention stays float64 under `widened(torch.float32)`)."""
    wide = _WIDE.get()
    return None if wide is None or torch.promote_types(dtype, wide) == dtype else wide


def _sdpa(query, key, value, widen: bool = True, **kwargs) -> torch.Tensor:
    wide = widening(query.dtype) if widen else None
    if wide is None:
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    return F.scaled_dot_product_attention(query.to(wide), key.to(wide), value.to(wide), **kwargs).to(query.dtype)


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Leading padding columns of each row of a 2-D mask [B, T]: [B] long."""
    return (attention_mask.long().cumsum(dim=-1) == 0).sum(dim=-1)


def _roll(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] with each row's columns reordered by index [B, T]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def causal(query, key, value, scaling: float, left_pad: torch.Tensor | None = None, widen: bool = True) -> torch.Tensor:
    """Causal self-attention over a full sequence whose rows carry `left_pad` [B] padding columns first.

    Real tokens see exactly the real tokens at or before them; a padding query sees the real tokens and
    itself (its output is never used, and stays finite). `widen=False`: in the inputs' dtype under `widened` too
    (a prompt's rows, which every forward computes alike). Returns [B, H, T, D]."""
    gqa = query.shape[1] != key.shape[1]
    # Skipping the roll when no row is padded reads `left_pad` on the host: free on the CPU, a stall per layer
    # on a GPU, where the roll (a gather, linear in T) is always done instead.
    if left_pad is None or (query.device.type == "cpu" and not bool(left_pad.any())):
        return _sdpa(query, key, value, widen, is_causal=True, scale=scaling, enable_gqa=gqa)
    width = query.shape[2]
    columns = torch.arange(width, device=query.device)
    rolled = (columns + left_pad[:, None]) % width  # [B, T]: rolled column -> original column
    out = _sdpa(_roll(query, rolled), _roll(key, rolled), _roll(value, rolled), widen,
                is_causal=True, scale=scaling, enable_gqa=gqa)
    return _roll(out, (columns - left_pad[:, None]) % width)


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, q, D] -> [B, Hkv, G * q, D]: each KV head's G query heads stacked along the query axis."""
    batch, heads, rows, dim = query.shape
    return query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)


def grouped(query, key, value, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention under a boolean mask [B, Hkv or 1, q or 1, S] (True = visible), without copying K or V.

    Returns [B, H, q, D]."""
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if mask.shape[2] != 1 and groups > 1:  # per-row masks repeat for each folded query head
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], mask.shape[1], groups * rows, -1)
    out = _sdpa(_fold(query, kv_heads), key, value, attn_mask=mask, scale=scaling)  # [B, Hkv, G * q, D]
    # not `view`: CUDA's memory-efficient kernel (the one a boolean mask selects) returns [B, Hkv, G * q, D] as a
    # transposed [B, G * q, Hkv, D] buffer, which no view folds back when Hkv > 1 and G > 1 (a copy then)
    return out.reshape(batch, heads, rows, dim)


def grouped_probs(query, key, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities [B, H, q, S] in float32 under mask [B, 1 or Hkv, q, S], without copying K.

    The scores are computed in the compute dtype (a bf16 matmul on GPU), the softmax in float32."""
    batch, heads, rows, _ = query.shape
    kv_heads = key.shape[1]
    scores = (_fold(query, kv_heads) @ key.transpose(-1, -2)) * scaling  # [B, Hkv, G * q, S]
    scores = scores.view(batch, kv_heads, heads // kv_heads, rows, -1).masked_fill(~mask[:, :, None], float("-inf"))
    return scores.softmax(dim=-1, dtype=torch.float32).view(batch, heads, rows, -1)
