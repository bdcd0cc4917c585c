"""A fixed-capacity KV cache that evicts by freeing slots, and the measurement of cache bytes.

`DynamicCache` appends with `torch.cat`, copying each layer at every step, and never shrinks. The
`EvictingCache` here allocates each layer once, right after that layer's prefill attention has run and
the policy has chosen what to keep, as `[B, Hkv, S, D]` slots with a per-slot original column (-1 = free)
and a per-slot score. Eviction only marks slots free; the next token is written into the first free
slot of each (row, KV head) in place, so memory stays flat for the whole rollout. Keys keep their true
RoPE positions (applied before they reach the cache). Slot order carries no meaning: attention over a set
of keys does not depend on their order, and the original columns say where each entry came from.

A decode step reads nothing back to the host: the column being decoded and the rows still active live in
device tensors updated in place (`begin_step`), and a full layer (the policy evicted too little) raises a
device-side flag that the rollout checks at its periodic host synchronisation (`check_capacity`). So the
step is fit for CUDA-graph capture: the same kernels on the same tensors at every step.

With an 8-bit `quant` (`kv.quant`, `smd_cli.attention.kv_quant`) the slots hold int8 / float8_e4m3fn codes and a float32 scale per
(row, KV head, slot): the prefill's kept entries are quantised by `fill` (the prefill itself attended to the fresh
ones), every decode step's token by `update`, and attention reads the layer back dequantised into the compute dtype
(`read`): one layer's worth at a time, freed after that layer's attention (the CUDA path does the same; no 8-bit
attention kernel). Each quantised element's rounding direction goes into the rollout's record (`rounding`), which
lets the learner reproduce the codes exactly (`smd_cli.attention.kv_quant.CacheReads`).

`kv_bytes` measures what a cache holds from its allocated tensors (storage nbytes), for this cache and
for transformers' `DynamicCache` alike; `KVMeter` keeps them per forward of a rollout, for the peak.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from smd_cli.attention import kv_quant

FREE = -1


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes viewed as uint8 (the same storage): copies and scatters of float8 run on every device."""
    return codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes


class EvictingLayer(CacheLayerMixin):
    """One layer's slots: keys/values [B, Hkv, S, D], columns [B, Hkv, S] int32, scores [B, Hkv, S] float32."""

    def __init__(self, capacity: int, quant: str = "none"):
        super().__init__()
        self.capacity = int(capacity)
        self.quant = kv_quant.check_kind(quant)  # "none": keys/values in the compute dtype; else 8-bit codes
        self.key_scales: torch.Tensor | None = None  # [B, Hkv, S] float32 with an 8-bit `quant`, else None
        self.value_scales: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None  # what attention reads (the compute dtype)
        self.rounding: torch.Tensor | None = None  # [B, 2, Hkv, T, D / 8] uint8: the rollout's record of rounding directions
        self.columns: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.overflow: torch.Tensor | None = None  # [] bool: a write found no free slot (checked by the rollout)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("EvictingLayer is initialised by `fill` after the prefill attention, not lazily")

    def fill(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, ok: torch.Tensor, scores: torch.Tensor) -> None:
        """Allocate the layer and copy the kept prompt entries `index` [B, Hkv, K] of keys/values [B, Hkv, P, D]."""
        batch, kv_heads, _, head_dim = keys.shape
        kept = index.shape[-1]
        if kept > self.capacity:
            raise ValueError(f"{kept} kept prompt entries exceed the cache capacity {self.capacity}")
        gather = index[..., None].expand(-1, -1, -1, head_dim)
        self.dtype = keys.dtype
        if self.quant == "none":
            self.keys = keys.new_zeros(batch, kv_heads, self.capacity, head_dim)  # [B, Hkv, S, D]
            self.values = values.new_zeros(batch, kv_heads, self.capacity, head_dim)
            self.keys[:, :, :kept] = keys.gather(2, gather)
            self.values[:, :, :kept] = values.gather(2, gather)
        else:  # 8-bit codes [B, Hkv, S, D] and float32 scales [B, Hkv, S]
            codes = kv_quant.DTYPES[self.quant]
            self.keys = torch.zeros(batch, kv_heads, self.capacity, head_dim, dtype=codes, device=keys.device)
            self.values = torch.zeros(batch, kv_heads, self.capacity, head_dim, dtype=codes, device=keys.device)
            self.key_scales = torch.zeros(batch, kv_heads, self.capacity, device=keys.device)
            self.value_scales = torch.zeros(batch, kv_heads, self.capacity, device=keys.device)
            for k, (slots, scales, states) in enumerate(((self.keys, self.key_scales, keys), (self.values, self.value_scales, values))):
                stored, scale, up = kv_quant.quantise_recorded(states, self.quant)  # every prompt entry: [B, Hkv, P, D], [B, Hkv, P]
                _bytes(slots)[:, :, :kept] = _bytes(stored).gather(2, gather)
                scales[:, :, :kept] = scale.gather(2, index)
                if self.rounding is not None:
                    self.rounding[:, k, :, : states.shape[2]] = kv_quant.pack(up)
        self.columns = torch.full((batch, kv_heads, self.capacity), FREE, dtype=torch.int32, device=keys.device)
        self.columns[:, :, :kept] = torch.where(ok, index, FREE).to(torch.int32)
        self.scores = torch.zeros(batch, kv_heads, self.capacity, device=keys.device)
        self.scores[:, :, :kept] = scores.float().masked_fill(~ok, 0.0)
        self.overflow = torch.zeros((), dtype=torch.bool, device=keys.device)
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states, value_states, column: torch.Tensor | None = None, active: torch.Tensor | None = None, **kwargs):
        """Write one new token [B, Hkv, 1, D] at `column` (a [] long tensor) into the first free slot of each
        (row, KV head); rows not `active` [B] (finished) write nothing visible. Before `fill`, return the
        prompt states untouched. No host synchronisation: a layer with no free slot sets `overflow`."""
        if not self.is_initialized:
            return key_states, value_states
        if key_states.shape[2] != 1 or column is None:
            raise ValueError(f"EvictingLayer decodes one token at a time with its column; got {key_states.shape[2]} tokens")
        free = self.columns == FREE  # [B, Hkv, S]
        self.overflow |= ~free.any(dim=-1).all()
        slot = free.int().argmax(dim=-1, keepdim=True)  # [B, Hkv, 1]
        head_dim = key_states.shape[-1]
        rows = slot[..., None].expand(-1, -1, -1, head_dim)
        new_column = torch.where(active, column, FREE).to(torch.int32)[:, None, None]  # [B, 1, 1]
        self.columns.scatter_(2, slot, new_column.expand_as(slot))
        self.scores.scatter_(2, slot, 0.0)
        if self.quant == "none":
            self.keys.scatter_(2, rows, key_states)
            self.values.scatter_(2, rows, value_states)
            return self.keys, self.values
        pairs = ((self.keys, self.key_scales, key_states), (self.values, self.value_scales, value_states))
        for k, (slots, scales, states) in enumerate(pairs):
            stored, scale, up = kv_quant.quantise_recorded(states, self.quant)  # [B, Hkv, 1, D], [B, Hkv, 1]
            _bytes(slots).scatter_(2, rows, _bytes(stored))
            scales.scatter_(2, slot, scale)
            if self.rounding is not None:  # at the token's column, on the device (no host read)
                self.rounding[:, k].index_copy_(2, column.view(1), kv_quant.pack(up))
        return self.read()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values [B, Hkv, S, D] as attention reads them: dequantised into the compute dtype,
        one layer at a time (freed after the layer's attention), or the stored tensors themselves."""
        if self.quant == "none":
            return self.keys, self.values
        return (kv_quant.dequantise(self.keys, self.key_scales, self.dtype),
                kv_quant.dequantise(self.values, self.value_scales, self.dtype))

    def evict(self, slots: torch.Tensor) -> torch.Tensor:
        """Free `slots` [B, Hkv, S] bool; returns the columns they held (FREE where not evicted)."""
        evicted = torch.where(slots, self.columns, FREE)
        self.columns.masked_fill_(slots, FREE)
        self.scores.masked_fill_(slots, 0.0)
        return evicted

    def valid(self) -> torch.Tensor:
        return self.columns >= 0  # [B, Hkv, S]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.capacity if self.is_initialized else query_length), 0

    def get_seq_length(self) -> int:
        """Most entries held by one (row, KV head): reads the device (not used while decoding)."""
        return int(self.valid().sum(dim=-1).max()) if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.capacity


class EvictingCache(Cache):
    """`Cache` of `EvictingLayer`s. The rollout sets the column being decoded with `begin_step`: `column` (a
    Python int, for the host's bookkeeping) and `column_tensor` / `active`, device tensors written in place
    (the same storage at every step, as a captured CUDA graph needs)."""

    def __init__(self, num_layers: int, capacity: int, quant: str = "none"):
        super().__init__(layers=[EvictingLayer(capacity, quant) for _ in range(num_layers)])
        self.column: int | None = None
        self.column_tensor: torch.Tensor | None = None  # [] long
        self.active: torch.Tensor | None = None  # [B] bool

    def begin_step(self, column: int, active: torch.Tensor) -> None:
        """The next `update` calls write the token at `column`; rows with `active` False [B] stay hidden."""
        self.column = int(column)
        if self.active is None:
            self.column_tensor = torch.full((), self.column, dtype=torch.long, device=active.device)
            self.active = active.clone()
        else:
            self.column_tensor.fill_(self.column)
            self.active.copy_(active)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, column=self.column_tensor, active=self.active)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """transformers' mask preparation asks for it at every forward; the smd attention does not use it, and
        the default (`get_seq_length`) would read the device: the column being decoded, from the host."""
        return self.column if self.layers[layer_idx].is_initialized and self.column is not None else 0

    def overflowed(self) -> torch.Tensor:
        """[] bool on the device: whether any layer found no free slot for a new token since `fill`."""
        flags = [layer.overflow for layer in self.layers if layer.is_initialized]
        return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)

    def check_capacity(self) -> None:
        """Raise if a layer overflowed (reads the device: the rollout calls it at its periodic synchronisation)."""
        if bool(self.overflowed()):
            capacity = self.layers[0].capacity
            raise RuntimeError(f"EvictingLayer is full (capacity {capacity}); the policy evicted too little")


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors` (each storage counted once): what is allocated, not numel."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def kv_bytes(cache: Cache) -> int:
    """Key and value bytes a transformers cache holds (DynamicCache or EvictingCache), from its storages: with an
    8-bit `kv.quant`, the codes and their float32 scales."""
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values, getattr(layer, "key_scales", None),
                                                                getattr(layer, "value_scales", None)))


def bookkeeping_bytes(cache: Cache) -> int:
    """Bytes of an EvictingCache's per-slot columns and scores, and of an 8-bit cache's record of rounding directions
    (0 for other caches)."""
    return tensor_bytes(t for layer in cache.layers for t in (getattr(layer, "columns", None), getattr(layer, "scores", None),
                                                                getattr(layer, "rounding", None)))


class KVMeter:
    """KV and bookkeeping bytes of one cache after every forward of a rollout (host-side: storage sizes, no
    device read), so that the peak can be taken over the forwards a rollout keeps (`peaks(forwards)`)."""

    def __init__(self):
        self.history: list[tuple[int, int]] = []  # (kv bytes, bookkeeping bytes) per forward

    def observe(self, cache: Cache) -> None:
        self.history.append((kv_bytes(cache), bookkeeping_bytes(cache)))

    def peaks(self, forwards: int | None = None) -> tuple[int, int]:
        """Peak KV bytes and peak bookkeeping bytes over the first `forwards` observations (all by default)."""
        kept = self.history[:forwards] or [(0, 0)]
        return max(b for b, _ in kept), max(b for _, b in kept)
