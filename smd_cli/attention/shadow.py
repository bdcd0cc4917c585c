"""The shadow mask: its encoding, and the attention that replays it in the learner.

Encoding (DESIGN.md section 2): `evict_at[B, L, Hkv, T]` int32, the first query column that can no longer
see key column `j`. Query `i` attends key `j` iff `j <= i < evict_at[b, l, h, j]`; never-evicted keys hold
a sentinel >= T; prompt keys evicted at prefill hold `P` (the padded prompt width: the first response
token's logits come from the dense prefill); padding keys hold 0. A real token's own key is visible to it
(`evict_at[i] > i`), so `evict_at` also says which query rows are real: padding rows attend only themselves,
which keeps softmax free of NaN. That is the whole rule (`visibility`).

Replay (`replay`, called by the model's attention for a forward given `shadow=Replay(...)`), per layer:
- backend "sdpa" (CPU, and anywhere flex is not wanted): the prompt rows (i < P) are plain causal
  attention with left padding (evictions start at P), so they take the mask-free causal kernel; only the
  response rows build a per-KV-head mask [B, Hkv, R, T], with the query groups folded (`kernels.grouped`).
- backend "flex" (CUDA by default): `flex_attention`, compiled once per process and made shape-generic at the
  first change of B or T (`compiled_flex`), with one `BlockMask` per forward and grid (`Replay.flex_mask`: the whole sequence, or the
  response rows after a prompt computed once for its samples), built from block indices alone (every causal
  block, no [T, T] evaluation) and shared by all layers and by the recompute of gradient checkpointing, as is the
  grid's first query column (a 0-d device tensor, made once per forward, not per layer); each layer swaps in a
  `mask_mod` that reads its own slice of `evict_at`, so nothing T x T is ever materialised.
  A compile that fails warns once and the replay runs on SDPA from then on (`flex_failure`); anything else the
  kernel raises propagates, an out-of-memory error with the planner's advice (`smd_cli.attention.replay_errors`: the SDPA
  replay needs more memory, so it is no way out). The CPU, where flex has no backward, replays with SDPA wherever
  a gradient is needed.
With a rollout's 8-bit KV cache (`Replay.quant`, `smd_cli.attention.kv_quant.CacheReads`), the prompt rows attend to full-precision
keys and values as the sampler's prefill did, and the response rows (its decode steps) to keys and values quantised
as its cache held them (straight-through gradient; the flex backend then runs on the response rows' grid alone).
The `Replay` travels as a keyword argument of the forward, so the recompute that gradient checkpointing
runs during `backward()` replays the very same mask.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch

from smd_cli.attention import kernels
from smd_cli.attention.kv_quant import CacheReads
from smd_cli.attention.replay_errors import compile_failure, device_error, out_of_memory_advice

NEVER = torch.iinfo(torch.int32).max  # sentinel while the final width is not known yet
FLEX_BLOCK = 128  # flex_attention's default sparse block size


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


def none_evicted(evict_at: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A shadow mask of evict_at's shape [B, L, Hkv, T] that evicts nothing: T on real columns, 0 on padding (the
    replay of a rollout's KV quantisation alone, without its evictions)."""
    width = attention_mask.shape[1]
    real = attention_mask.bool()[:, None, None, :].expand(evict_at.shape)
    return torch.where(real, width, 0).to(evict_at.dtype)


def decode_visibility(evict_at: torch.Tensor) -> torch.Tensor:
    """The full mask [B, L, Hkv, T, T] (tests and debugging only: the learner never builds it)."""
    columns = torch.arange(evict_at.shape[-1], device=evict_at.device)
    return torch.stack([visibility(evict_at[:, layer], columns) for layer in range(evict_at.shape[1])], dim=1)


def kept_through(evict_at: torch.Tensor, columns: list[list[int]]) -> torch.Tensor:
    """Per layer [L]: the fraction of the named keys that no query of the rollout lost, over rows, keys and KV
    heads. evict_at [B, L, Hkv, T] (final, never-evicted = T); `columns[b]` the key columns of row b (may be
    empty). NaN when no row names a key."""
    rows = [b for b, cols in enumerate(columns) for _ in cols]
    if not rows:
        return torch.full((evict_at.shape[1],), float("nan"))
    keys = torch.tensor([c for cols in columns for c in cols], device=evict_at.device)
    picked = evict_at[torch.tensor(rows, device=evict_at.device), :, :, keys]  # [n, L, Hkv]
    return (picked >= evict_at.shape[-1]).float().mean(dim=(0, 2)).cpu()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Real-token positions with left padding: cumsum - 1, padding at 0. [B, T] long."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def check_evict_at(evict_at, input_ids, attention_mask, prompt_length: int) -> None:
    """Reject a shadow mask that does not fit the batch or breaks the encoding's invariants: a real key
    is seen by its own query (`evict_at[j] > j`), nothing is evicted before the prompt ends, and padding
    keys hold 0."""
    if evict_at.dim() != 4 or evict_at.shape[0] != input_ids.shape[0] or evict_at.shape[-1] != input_ids.shape[1]:
        raise ValueError(f"evict_at {tuple(evict_at.shape)} does not match input_ids {tuple(input_ids.shape)} as [B, L, Hkv, T]")
    columns = torch.arange(input_ids.shape[1], device=evict_at.device)
    real = attention_mask.bool()[:, None, None, :]
    floor = columns.clamp(min=prompt_length - 1)  # a real key lives at least until P (prefill) or its own query
    if bool((real & (evict_at <= floor)).any()):
        raise ValueError("evict_at hides a real key from its own query or before the prompt ends (values must exceed max(j, P - 1))")
    if bool((~real & (evict_at != 0)).any()):
        raise ValueError("evict_at must hold 0 on padding columns (padding keys are never visible)")


@dataclass
class Replay:
    """What a forward needs to replay a rollout's shadow mask; passed to the model as `shadow=`.

    evict_at [B, L, Hkv, T]; prompt_length P (prompt rows share plain causal attention); backend "sdpa" or
    "flex"; block_masks: the flex `BlockMask`s of the forward, one per grid (the whole [T, T] square, or the
    response rows' [R, T]), built once and shared by every layer and the recompute; key_columns / query_columns:
    for the physical learner's chunks, the original columns of the cached keys (a list per layer of [B, Hkv, S])
    and of the queries [q]."""

    evict_at: torch.Tensor
    prompt_length: int = 0
    backend: str = "sdpa"
    block_masks: dict = field(default_factory=dict)
    left_pad: torch.Tensor | None = None  # [B] padding columns before each prompt
    key_columns: list[torch.Tensor] | None = None
    query_columns: torch.Tensor | None = None
    quant: CacheReads | None = None  # the rollout's 8-bit cache: the response rows read keys and values as it held them

    def rows(self, rows: slice) -> "Replay":
        """The replay of some rows of the batch (the block masks hold for any rows: they are [1, 1])."""
        left_pad = None if self.left_pad is None else self.left_pad[rows]
        quant = None if self.quant is None else self.quant.rows(rows)
        return Replay(self.evict_at[rows], self.prompt_length, self.backend, self.block_masks, left_pad, quant=quant)

    def read(self, layer: int, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor | None = None) -> tuple:
        """Keys and values [B, Hkv, S, D] of `layer` (at key columns 0 .. S-1, or `columns` [B, Hkv, S]) as the rollout's
        decode steps read them: through its 8-bit cache (`smd_cli.attention.kv_quant.CacheReads`, straight-through gradient), or
        as they are."""
        if self.quant is None:
            return key, value
        if self.quant.flips is not None and columns is None:  # count over entries a decode step held: not evicted at the
            evict_layer, width = self.evict_at[:, layer], key.shape[2]  # prefill, not the last column (never fed)
            held = (evict_layer > self.prompt_length) & (torch.arange(width, device=key.device) < width - 1)
            self.quant.flips.append(self.quant.count_flips(layer, key, value, held))
        return self.quant.read(layer, key, value, columns)

    def flex_mask(self, queries: int, width: int):
        """(BlockMask, start) of the grid of `queries` query columns ending at column width-1 against `width` keys:
        the causal BlockMask, and the first query column as a 0-d long tensor on the device (None for the whole
        square). Built at the first layer, reused by every other layer and the recompute: a scalar made per layer
        was a blocking host-to-device copy per layer on CUDA."""
        if (queries, width) not in self.block_masks:
            device, start = self.evict_at.device, width - queries
            self.block_masks[(queries, width)] = (causal_block_mask(width, device, start=start),
                                                  torch.full((), start, dtype=torch.long, device=device) if start else None)
        return self.block_masks[(queries, width)]

    @classmethod
    def of(cls, evict_at, attention_mask, prompt_length: int, backend: str = "auto", quant: CacheReads | None = None) -> "Replay":
        """The replay of a whole forward: picks the backend ("auto": flex on CUDA) and works out what the layers
        share (the prompt padding; flex's block masks, built at the first layer). `quant`: the rollout's kv.quant."""
        backend = resolve_backend(backend, evict_at.device)
        return cls(evict_at, prompt_length, backend, {}, kernels.left_padding(attention_mask[:, :prompt_length]), quant=quant)


def resolve_backend(backend: str, device) -> str:
    """The replay kernel a forward on `device` runs: "auto" is flex on CUDA, SDPA elsewhere."""
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"shadow replay backend must be 'auto', 'sdpa' or 'flex', got {backend!r}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


def replay(layer: int, query, key, value, scaling: float, shadow: Replay) -> torch.Tensor:
    """Attention of layer `layer` under the shadow mask: [B, H, q, D]."""
    evict_layer = shadow.evict_at[:, layer]  # [B, Hkv, T]
    if shadow.key_columns is not None:
        mask = visibility(evict_layer, shadow.query_columns, shadow.key_columns[layer])  # [B, Hkv, q, S]
        return kernels.grouped(query, *shadow.read(layer, key, value, shadow.key_columns[layer]), mask, scaling)
    if shadow.backend == "flex" and shadow.quant is None and kernels.widening(query.dtype) is None:  # flex has no wide mode
        out = _flex(query, key, value, evict_layer, *shadow.flex_mask(query.shape[2], key.shape[2]), scaling=scaling)
        if out is not None:
            return out
    prompt_length, width = shadow.prompt_length, query.shape[2]
    pieces = []
    if prompt_length > 0:
        pieces.append(kernels.causal(query[:, :, :prompt_length], key[:, :, :prompt_length], value[:, :, :prompt_length],
                                     scaling, shadow.left_pad, widen=False))  # as the sampler's prefill computed them
    if prompt_length < width:  # the response rows: decode steps, which read the (quantised) cache
        rows = query[:, :, prompt_length:]
        pieces.append(_sdpa_rows(layer, rows, key, value, scaling, shadow) if shadow.quant is None else
                      replay_rows(layer, rows, key, value, scaling, shadow))
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def replay_rows(layer: int, query, key, value, scaling: float, shadow: Replay) -> torch.Tensor:
    """The replay's response rows alone: queries [B, H, R, D] at columns P .. T-1 over all T keys [B, Hkv, T, D]
    (the rows that follow a prompt computed once for its samples, `scoring.shared_prompt_views`). [B, H, R, D].

    flex: the block mask of the [R, T] grid, no mask materialised; sdpa: one layer's mask [B, Hkv, R, T] with the
    query groups folded (`kernels.grouped`). With the rollout's kv.quant, over the keys and values its cache held."""
    key, value = shadow.read(layer, key, value)
    if shadow.backend == "flex" and kernels.widening(query.dtype) is None:
        out = _flex(query, key, value, shadow.evict_at[:, layer], *shadow.flex_mask(query.shape[2], key.shape[2]), scaling=scaling)
        if out is not None:
            return out
    return _sdpa_rows(layer, query, key, value, scaling, shadow)


def _sdpa_rows(layer: int, query, key, value, scaling: float, shadow: Replay) -> torch.Tensor:
    width = key.shape[2]
    columns = torch.arange(width - query.shape[2], width, device=query.device)
    return kernels.grouped(query, key, value, visibility(shadow.evict_at[:, layer], columns), scaling)


def causal_block_mask(width: int, device, block: int = FLEX_BLOCK, start: int = 0):
    """A flex `BlockMask` [1, 1] over every causal block of the grid of query columns start .. width-1 against key
    columns 0 .. width-1 (start = 0: the whole [width, width] square; start = P: the response rows alone), all of
    them partial.

    Built from the block indices alone (O((T / block)^2) integers, no mask evaluated): the shadow mask only
    ever hides more than causal attention does, so each layer can reuse it with its own `mask_mod`."""
    from torch.nn.attention.flex_attention import BlockMask

    key_blocks, query_blocks = -(-width // block), -(-(width - start) // block)
    last_column = start + (torch.arange(query_blocks, device=device) + 1) * block - 1  # [Qb] each query block's last column
    kv_num_blocks = (last_column.clamp(max=width - 1) // block + 1).to(torch.int32)[None, None]  # [1, 1, Qb]: key blocks 0..
    kv_indices = torch.arange(key_blocks, device=device, dtype=torch.int32).expand(query_blocks, key_blocks).contiguous()[None, None]
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block, seq_lengths=(width - start, width))


def layer_mask_mod(evict_layer: torch.Tensor, groups: int, start: torch.Tensor | None = None):
    """flex `mask_mod` of one layer: the encoding's rule, read from evict_layer [B, Hkv, T], for queries whose
    column is `start` (a 0-d tensor: a Python int would be compiled in as a constant) plus their index."""

    def mask_mod(b, h, q_idx, kv_idx):
        kv_head = h // groups
        column = q_idx if start is None else q_idx + start
        seen = (kv_idx <= column) & (column < evict_layer[b, kv_head, kv_idx]) & (column < evict_layer[b, kv_head, column])
        return seen | (column == kv_idx)

    return mask_mod


_compiled_flex = None
_flex_failure: str | None = None  # why the compiled flex_attention is off for this process, once it failed


def flex_failure() -> str | None:
    """Why the compiled flex_attention fell back to the SDPA replay in this process (None: it has not)."""
    return _flex_failure


def compiled_flex():
    """flex_attention compiled once per process, on every device (the CPU's inductor too), with dynamo's automatic
    dynamic shapes: the first call compiles for its sizes, the first call with other sizes recompiles the kernel
    with those sizes symbolic, and every later call reuses it.

    RL batches change T at almost every step: `dynamic=False` compiled a kernel per (B, T) until, at the ninth,
    dynamo's recompile limit ran flex eagerly, with [B, H, T, T] scores. The first compile cannot be symbolic in T
    (the BlockMask carries its lengths as Python ints, which flex checks against the inputs'), and `dynamic=True`
    (heads and head_dim symbolic too) fails the CPU flex template's compile, as does a symbolic batch size with a
    static T: B stays static (`_flex`), a compile per micro-batch size (a run has two or three). Dynamo also
    specialises a T within one 128-block, the whole sequence against the response rows alone, and the grad mode:
    a run compiles a handful of times, not once per shape."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _without_backward(query) -> bool:
    """The CPU's compiled flex has no backward: the replay runs on SDPA where a gradient is needed."""
    return query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad


def _flex(query, key, value, evict_layer, block_mask, start: torch.Tensor | None = None, *, scaling: float):
    """Compiled flex_attention with the forward's shared BlockMask and first query column `start` (None: the whole
    square) and this layer's mask_mod: [B, H, q, D], or None when flex cannot run here (a failed compile: warned
    once, the caller replays with SDPA). An out-of-memory error propagates with the planner's advice, any other
    runtime error as it came."""
    global _flex_failure
    if _flex_failure is not None:
        return None
    if _without_backward(query):
        _warn_once("flex_attention has no backward on the CPU; the shadow replay runs on SDPA where a gradient is needed")
        return None
    groups = query.shape[1] // key.shape[1]
    evict_layer = evict_layer.contiguous()  # [B, Hkv, T]: a strided slice of evict_at fails the CPU flex template's compile
    for tensor in (query, key, value, evict_layer):
        torch._dynamo.mark_static(tensor, 0)  # B: a symbolic batch with a static T fails the CPU flex template's compile
    layer_mask = copy.copy(block_mask)  # same block indices, this layer's mask_mod
    layer_mask.mask_mod = layer_mask_mod(evict_layer, groups, start)
    try:
        return compiled_flex()(query, key, value, block_mask=layer_mask, scale=scaling, enable_gqa=groups > 1)
    except Exception as err:
        cause = device_error(err)
        if isinstance(cause, torch.OutOfMemoryError):
            raise torch.OutOfMemoryError(out_of_memory_advice(cause, query, key)) from err
        if not compile_failure(err):
            raise  # a kernel's runtime error: switching kernels would hide it
        lines = str(err).strip().splitlines()  # a failed compile: warn once, then the SDPA replay from here on
        _flex_failure = f"{type(err).__name__}: {lines[0] if lines else ''}"
        _warn_once(f"the shadow replay's compiled flex_attention failed ({_flex_failure}); replaying with SDPA (the CPU-tested "
                   "path) for the rest of this process")
        return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
