"""The shadow mask: its encoding, and the attention that replays it in the learner.

Encoding (DESIGN.md section 2): `evict_at[B, L, Hkv, T]` int32, the first query column that can no longer
see key column `j`. Query `i` attends key `j` iff `j <= i < evict_at[b, l, h, j]`; never-evicted keys hold
a sentinel >= T; prompt keys evicted at prefill hold `P` (the padded prompt width: the first response
token's logits come from the dense prefill); padding keys hold 0. A real token's own key is visible to it
(`evict_at[i] > i`), so `evict_at` also says which query rows are real: padding rows attend only themselves,
which keeps softmax free of NaN. That is the whole rule (`visibility`).

Replay: the attention function `SHADOW` (registered with transformers' `AttentionInterface`, with a mask
function that hands it the 2-D padding mask) reads `evict_at` from the forward's keyword arguments and
builds one layer's mask at a time, expanded from KV heads to query heads, for SDPA (CPU, with backward);
or, with the flex backend (CUDA by default), a `BlockMask` from a `mask_mod` reading `evict_at`, so that
no T x T mask is ever materialised. `response_logits` and `token_logprobs` are what the learner calls.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

SHADOW = "smd_shadow"
NEVER = torch.iinfo(torch.int32).max  # sentinel while the final width is not known yet


def visibility(evict_at: torch.Tensor, query_columns: torch.Tensor, key_columns: torch.Tensor | None = None) -> torch.Tensor:
    """Decode one layer's mask. evict_at [B, Hkv, T]; query_columns [q]; key_columns [B, Hkv, S] (-1 = empty
    slot) or None for all T columns in order. Returns [B, Hkv, q, S] bool."""
    if key_columns is None:
        key_columns = torch.arange(evict_at.shape[-1], device=evict_at.device).expand_as(evict_at)
    key_columns = key_columns.long()
    key_until = evict_at.gather(-1, key_columns.clamp(min=0))  # [B, Hkv, S]
    query_until = evict_at[..., query_columns]  # [B, Hkv, q]
    i = query_columns.long()[:, None]  # [q, 1]
    j = key_columns[..., None, :]  # [B, Hkv, 1, S]
    seen = (j >= 0) & (j <= i) & (i < key_until[..., None, :]) & (i < query_until[..., :, None])
    return seen | (j == i)


def decode_visibility(evict_at: torch.Tensor) -> torch.Tensor:
    """The full mask [B, L, Hkv, T, T] (tests and debugging only: the learner never builds it)."""
    columns = torch.arange(evict_at.shape[-1], device=evict_at.device)
    return torch.stack([visibility(evict_at[:, layer], columns) for layer in range(evict_at.shape[1])], dim=1)


def sdpa_per_kv_head(query, key, value, mask, scaling):
    """SDPA with a per-KV-head boolean mask [B, Hkv, q, S], expanded to the query heads."""
    groups = query.shape[1] // key.shape[1]
    mask = mask.repeat_interleave(groups, dim=1)  # [B, H, q, S]: one layer at a time
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


_compiled_flex = None


def _flex(query, key, value, evict_layer, scaling):
    """flex_attention with a BlockMask whose mask_mod reads evict_at [B, Hkv, T]: nothing T x T is built."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    groups = query.shape[1] // key.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (kv_idx <= q_idx) & (q_idx < evict_layer[b, h // groups, kv_idx]) & (q_idx < evict_layer[b, h // groups, q_idx])
        return seen | (q_idx == kv_idx)

    batch, heads, width = query.shape[0], query.shape[1], query.shape[2]
    block_mask = create_block_mask(mask_mod, batch, heads, width, key.shape[2], device=query.device)
    if query.is_cuda and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    if query.is_cuda:
        return _compiled_flex(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=groups > 1)
    with warnings.catch_warnings():  # eager CPU flex (forward-only parity checks) warns that it is unfused
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=groups > 1)


def _replay(query, key, value, evict_layer, prompt_length: int, scaling):
    """Replay over all T columns. Query rows before `prompt_length` only ever see a causal, padded prompt
    (evictions start at P), so they share one [B, 1, P, P] mask, as in the dense learner; only the response
    rows need per-head masks [B, H, R, T]. Same result as one [B, H, T, T] mask, a fraction of its memory."""
    columns = torch.arange(query.shape[2], device=query.device)
    pieces = []
    if prompt_length > 0:
        # Without left padding the prompt rows are plain causal attention: SDPA's fused causal path, no mask.
        padded = bool((evict_layer[:, :1, :prompt_length] == 0).any())
        shared = visibility(evict_layer[:, :1, :prompt_length], columns[:prompt_length]) if padded else None  # [B, 1, P, P]
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, :prompt_length], key[:, :, :prompt_length], value[:, :, :prompt_length],
            attn_mask=shared, is_causal=not padded, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
        ))
    if prompt_length < query.shape[2]:
        mask = visibility(evict_layer, columns[prompt_length:])  # [B, Hkv, R, T]
        pieces.append(sdpa_per_kv_head(query[:, :, prompt_length:], key, value, mask, scaling))
    return torch.cat(pieces, dim=2)


def shadow_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention under the shadow mask of layer `module.layer_idx`.

    Keyword arguments of the forward: `shadow_evict_at` [B, L, Hkv, T] (required); `shadow_prompt_length`
    (P, lets prompt rows share one mask); `shadow_key_columns` (a list, per layer, of [B, Hkv, S] columns of
    the cached keys, for the physical learner's chunks) with `shadow_query_columns` [q];
    `shadow_backend` "sdpa" | "flex" | "auto" (flex on CUDA). A 2-D padding mask, when given, is folded in:
    padding keys are hidden and padding rows see only themselves, whatever `evict_at` says."""
    evict_at = kwargs.get("shadow_evict_at")
    if evict_at is None:
        raise ValueError(f"the {SHADOW!r} attention needs `shadow_evict_at=` in the forward's keyword arguments")
    evict_layer = evict_at[:, module.layer_idx]  # [B, Hkv, T]
    if attention_mask is not None and attention_mask.dim() == 2:
        evict_layer = evict_layer.masked_fill(~attention_mask[:, None, :].bool(), 0)
    key_columns = kwargs.get("shadow_key_columns")
    backend = kwargs.get("shadow_backend", "auto")
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"shadow_backend must be 'auto', 'sdpa' or 'flex', got {backend!r}")
    if key_columns is not None:
        mask = visibility(evict_layer, kwargs["shadow_query_columns"], key_columns[module.layer_idx])  # [B, Hkv, q, S]
        out = sdpa_per_kv_head(query, key, value, mask, scaling)
    elif backend == "flex" or (backend == "auto" and query.is_cuda):
        out = _flex(query, key, value, evict_layer, scaling)
    else:
        out = _replay(query, key, value, evict_layer, int(kwargs.get("shadow_prompt_length", 0)), scaling)
    return out.transpose(1, 2).contiguous(), None


def _padding_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask function of `SHADOW`: hand the 2-D padding mask [B, T] through; the per-layer mask is built from
    `evict_at` inside the attention (without this, transformers would pass None and build nothing)."""
    return attention_mask


AttentionInterface.register(SHADOW, shadow_attention)
AttentionMaskInterface.register(SHADOW, _padding_mask)


@contextmanager
def attention_implementation(model, name: str):
    """Run `model` with the registered attention implementation `name`, then restore the previous one."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield model
    finally:
        model.config._attn_implementation = previous


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Real-token positions with left padding: cumsum - 1, padding at 0. [B, T] long."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def check_evict_at(evict_at, input_ids, attention_mask, prompt_length: int) -> None:
    """Reject a shadow mask that does not fit the batch or breaks the encoding's invariants: a real key
    is seen by its own query (`evict_at[j] > j`) and nothing is evicted before the prompt ends."""
    if evict_at.dim() != 4 or evict_at.shape[0] != input_ids.shape[0] or evict_at.shape[-1] != input_ids.shape[1]:
        raise ValueError(f"evict_at {tuple(evict_at.shape)} does not match input_ids {tuple(input_ids.shape)} as [B, L, Hkv, T]")
    columns = torch.arange(input_ids.shape[1], device=evict_at.device)
    real = attention_mask.bool()[:, None, None, :]
    floor = columns.clamp(min=prompt_length - 1)  # a real key lives at least until P (prefill) or its own query
    if bool((real & (evict_at <= floor)).any()):
        raise ValueError("evict_at hides a real key from its own query or before the prompt ends (values must exceed max(j, P - 1))")


def response_logits(model, input_ids, attention_mask, prompt_length: int, evict_at=None, backend: str = "auto") -> torch.Tensor:
    """Logits predicting the R response tokens (positions P-1 .. T-2): [B, R, V].

    Dense when `evict_at` is None; otherwise the shadow replay of the rollout's evictions. Only R + 1
    positions' logits are materialised (`logits_to_keep`). Works with or without autograd."""
    response_width = input_ids.shape[1] - prompt_length
    if response_width < 1:
        raise ValueError(f"no response columns: input width {input_ids.shape[1]}, prompt_length {prompt_length}")
    position_ids = position_ids_from_mask(attention_mask)
    common = dict(position_ids=position_ids, use_cache=False, logits_to_keep=response_width + 1)
    if evict_at is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **common).logits
    else:
        check_evict_at(evict_at, input_ids, attention_mask, prompt_length)
        with attention_implementation(model, SHADOW):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, shadow_evict_at=evict_at, shadow_prompt_length=prompt_length,
                           shadow_backend=backend, **common).logits
    return logits[:, :-1]  # [B, R, V]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at `tokens`: [B, R] float32 (temperature 0, greedy, counts as 1)."""
    scale = 1.0 if temperature == 0 else float(temperature)
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, tokens.long()[..., None]).squeeze(-1)
