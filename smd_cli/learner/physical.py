"""The physical-eviction learner: the memory baseline of the paper, and a cross-check of the replay.

Instead of masking, it does what the sampler did: a dense prefill into a `DynamicCache`, then it slices the
cache down to the entries the rollout kept, teacher-forces the response, and slices again at every
recorded eviction (chunk by chunk: one chunk for prefill-time policies, one token at a time for H2O).
Evictions come from the recorded shadow mask `evict_at`, never from re-running the policy. Slicing copies
every layer's keys and values (`gather`), with autograd, which is the allocation spike it exists to
measure. Inside a chunk, the keys are masked with the same rule as the replay (`shadow.visibility` on the
cached entries' original columns), so padding and within-chunk causality are handled alike.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from smd_cli.attention.dispatch import cache_argument, use_smd_attention
from smd_cli.attention.kv_quant import CacheReads
from smd_cli.attention.shadow import Replay, position_ids_from_mask
from smd_cli.model import row_floor


def chunk_bounds(evict_at: torch.Tensor, prompt_length: int, width: int) -> list[int]:
    """Columns where the learner must evict before going on: 0, P, every recorded eviction time, T - 1."""
    times = evict_at[(evict_at > prompt_length) & (evict_at < width - 1)].unique().tolist()
    return sorted({0, prompt_length, width - 1, *times})


def compact(layer, columns: torch.Tensor, evict_layer: torch.Tensor, until: int) -> torch.Tensor:
    """Keep, per (row, KV head), the cached entries still visible at column `until` (gather = copy).

    columns [N, Hkv, S] original column of each cached entry (-1 = none); evict_layer [N, Hkv, T].
    Returns the columns of the new, shorter layer [N, Hkv, S'] (-1 on the padding of short heads)."""
    seen_until = evict_layer.gather(-1, columns.clamp(min=0))  # [N, Hkv, S]
    keep = (columns >= 0) & (seen_until > until)
    count = keep.sum(dim=-1, keepdim=True)  # [N, Hkv, 1]
    width = int(count.max())
    order = (~keep).int().argsort(dim=-1, stable=True)[..., :width]  # kept entries first, in order
    head_dim = layer.keys.shape[-1]
    layer.keys = layer.keys.gather(2, order[..., None].expand(-1, -1, -1, head_dim))
    layer.values = layer.values.gather(2, order[..., None].expand(-1, -1, -1, head_dim))
    ok = torch.arange(width, device=columns.device) < count
    return torch.where(ok, columns.gather(-1, order), -1)


def physical_response_logits(model, input_ids, attention_mask, prompt_length: int, evict_at: torch.Tensor,
                             quant: CacheReads | None = None) -> torch.Tensor:
    """Logits predicting the R response tokens [N, R, V], by physically evicting as the rollout did; after the prefill,
    reading the cached keys and values as the rollout's 8-bit cache `quant` held them (`RolloutBatch.cache_reads`)."""
    rows, width = input_ids.shape
    if evict_at.shape[0] != rows or evict_at.shape[-1] != width:
        raise ValueError(f"evict_at {tuple(evict_at.shape)} does not match input_ids {tuple(input_ids.shape)}")
    layers, kv_heads = evict_at.shape[1], evict_at.shape[2]
    position_ids = position_ids_from_mask(attention_mask)
    cache = DynamicCache(config=model.config)
    columns = [torch.empty(rows, kv_heads, 0, dtype=torch.long, device=input_ids.device) for _ in range(layers)]
    bounds = chunk_bounds(evict_at, prompt_length, width)
    pieces = []
    use_smd_attention(row_floor.apply(model))
    for start, stop in zip(bounds[:-1], bounds[1:]):
        query_columns = torch.arange(start, stop, device=input_ids.device)
        key_columns = [torch.cat([c, query_columns.expand(rows, kv_heads, -1)], dim=-1) for c in columns]
        if start == 0:  # the prefill, as the sampler ran it: plain causal attention over the padded prompts (`prompt_rows`)
            view = dict(attention_mask=attention_mask[:, :stop], prompt_rows=True, logits_to_keep=1)
        else:
            view = dict(shadow=Replay(evict_at, key_columns=key_columns, query_columns=query_columns, quant=quant), logits_to_keep=0)
        out = model(input_ids=input_ids[:, start:stop], position_ids=position_ids[:, start:stop], **cache_argument(model, cache),
                    use_cache=True, **view)
        pieces.append(out.logits)  # prefill: [N, 1, V] at P - 1; then [N, stop - start, V]
        columns = [compact(cache.layers[l], key_columns[l], evict_at[:, l], stop) for l in range(layers)]
    return torch.cat(pieces, dim=1)  # [N, R, V]
