"""KV-cache quantisation (`kv.quant`): 8-bit keys and values with one scale per (token, KV head), and its replay.

A vector x [..., D] (one token's key or value in one KV head, after RoPE) is stored as 8-bit codes and a float32
scale: `scale = absmax(x) / QMAX`, `code = Q(x / scale)`, read back as `code * scale` in the compute dtype.
- `int8`: QMAX = 127, Q = round half to even, clamped to [-127, 127] (symmetric, as vLLM's and KIVI's int8);
- `fp8_e4m3`: QMAX = 448 (the largest float8_e4m3fn), Q = the cast to torch.float8_e4m3fn (round to nearest even).
A zero vector has scale 0 and codes 0. `quantise` / `dequantise` are the one definition: the rollout's cache
(`smd_cli.attention.kv_cache`) stores what `quantise` returns and attends to what `dequantise` returns, and the learner's
shadow replay (`smd_cli.attention.shadow`) applies `fake_quant` (the two in one, with a straight-through gradient) to its own
keys and values. Per (token, KV head) because eviction frees single entries of one KV head: a scale shared by
several tokens would have to outlive its tokens, or change when they leave.

The learner's keys are the sampler's up to float rounding (a decode step against a full-sequence forward), so a
code can differ where x / scale sits within rounding of a tie between two codes. The rollout records, for every
element it quantises, which way it rounded (`up = code > x / scale`, one bit, `quantise_recorded`), and the learner
rounds its own value nudged by `NUDGE` of a code's spacing in that direction (`fake_quant(..., up=)`): the sampler's
code whenever the two values differ by less than `NUDGE` of a spacing (and `NUDGE` plus that difference stays under
half a spacing), as float32 rounding did in every rollout measured (README, "KV-cache quantisation"). In bf16 the two
can differ by more than that, and parity is not judged there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smd_cli.options import KV_KINDS

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
NUDGE = 2.0 ** -5  # of a code's spacing: far above float32 rounding of x / scale (~1e-4 of a spacing), far below 1/2
FP8_SUBNORMAL = 2.0 ** -9  # float8_e4m3fn's spacing below 2^-6 (its smallest normal); 2^-3 relative above


def check_kind(kind: str) -> str:
    if kind not in KV_KINDS:
        raise ValueError(f"kv.quant={kind!r}: choose one of {', '.join(KV_KINDS)}")
    return kind


def _scaled(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in float32 [..., D], scale [...] float32)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX[kind]  # [...]
    return x / torch.where(scale > 0, scale, 1.0)[..., None], scale


def _spacing(v: torch.Tensor, kind: str) -> torch.Tensor:
    """A code's spacing around v (x / scale): 1 for int8; float8_e4m3fn's 2^(exponent - 3), 2^-9 below 2^-6."""
    if kind == "int8":
        return torch.ones_like(v)
    exponent = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    return torch.exp2(exponent - 3).clamp(min=FP8_SUBNORMAL)


def _round(v: torch.Tensor, kind: str) -> torch.Tensor:
    """The codes of v (x / scale): int8 or float8_e4m3fn."""
    if kind == "int8":
        return v.round().clamp_(-127, 127).to(torch.int8)
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quantise(x: torch.Tensor, kind: str, up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] int8 / float8_e4m3fn, scales [...] float32). With `up` [..., D] bool (the
    sampler's rounding directions, `quantise_recorded`), x / scale is nudged by NUDGE of a spacing that way first."""
    v, scale = _scaled(x, kind)
    if up is not None:
        v = v + torch.where(up, NUDGE, -NUDGE) * _spacing(v, kind)
    return _round(v, kind), scale


def dequantise(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D], scales [...] -> code * scale [..., D] in `dtype` (what attention reads)."""
    return (codes.float() * scales[..., None]).to(dtype)


def quantise_recorded(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantise(x, kind)` and which way each element was rounded: (codes, scales, up [..., D] bool = code > x / scale)."""
    v, scale = _scaled(x, kind)
    codes = _round(v, kind)
    return codes, scale, codes.float() > v


class _FakeQuant(torch.autograd.Function):
    """`dequantise(quantise(x))` forward; the gradient passes straight through (STE)."""

    @staticmethod
    def forward(ctx, x, kind, up):
        return dequantise(*quantise(x, kind, up), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quant(x: torch.Tensor, kind: str, up: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] as the quantised cache holds it (in x's dtype), with a straight-through gradient; `kind` "none":
    x itself. `up`: the sampler's rounding directions of these elements (`quantise`)."""
    if kind == "none":
        return x
    return _FakeQuant.apply(x, kind, up)


def pack(bits: torch.Tensor) -> torch.Tensor:
    """[..., D] bool -> [..., ceil(D / 8)] uint8, element d in bit d % 8 of byte d // 8."""
    pad = -bits.shape[-1] % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    weights = (1 << torch.arange(8, device=bits.device, dtype=torch.int32))
    return (bits.view(*bits.shape[:-1], -1, 8).int() * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """`pack`'s inverse: [..., ceil(D / 8)] uint8 -> [..., dim] bool."""
    weights = (1 << torch.arange(8, device=packed.device, dtype=torch.int32))
    return ((packed.int()[..., None] & weights) != 0).flatten(-2)[..., :dim]


def packed_width(head_dim: int) -> int:
    return -(-head_dim // 8)


@dataclass
class CacheReads:
    """What a learner's view needs to read keys and values as a rollout's 8-bit cache held them: the rollout's `kind`
    and its rounding directions `rounding` [N, L, 2 (keys, values), Hkv, T, ceil(D / 8)] uint8 (`pack`ed
    `quantise_recorded` of every (row, layer, KV head, column) it quantised; None: the learner rounds its own values)."""

    kind: str
    rounding: torch.Tensor | None = None
    flips: list[int] | None = None  # when a list: the replay appends each layer's count of codes the record changed

    def rows(self, rows) -> "CacheReads":
        return CacheReads(self.kind, None if self.rounding is None else self.rounding[rows], self.flips)

    def directions(self, layer: int, head_dim: int, device, columns: torch.Tensor | None = None) -> tuple:
        """(keys', values' rounding directions [B, Hkv, T or S, D] bool) of `layer`, at key `columns` [B, Hkv, S]
        (-1: none) when given; (None, None) without a record."""
        if self.rounding is None:
            return None, None
        packed = self.rounding[:, layer].to(device)  # [B, 2, Hkv, T, D / 8]: the record stays on the host, one layer comes over
        if columns is not None:
            index = columns.long().clamp(min=0)[:, None, :, :, None].expand(-1, 2, -1, -1, packed.shape[-1])
            packed = packed.gather(3, index)
        bits = unpack(packed, head_dim)
        return bits[:, 0], bits[:, 1]

    def read(self, layer: int, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor | None = None) -> tuple:
        """Keys and values [B, Hkv, S, D] of `layer` as the cache held them (`fake_quant`, straight-through), for keys at
        columns 0 .. S-1 or at `columns` [B, Hkv, S]."""
        up_key, up_value = self.directions(layer, key.shape[-1], key.device, columns)
        return fake_quant(key, self.kind, up_key), fake_quant(value, self.kind, up_value)

    def count_flips(self, layer: int, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor) -> int:
        """Codes of `layer` [B, Hkv, T, D] that the learner's own rounding would give otherwise than the rollout's, over
        the `visible` [B, Hkv, T] entries (rounding-boundary flips from float noise: what the record repairs). Codes are
        compared as the numbers they hold: fp8's +0 and -0 (bytes 0x00, 0x80) are one value, not a flip."""
        up_key, up_value = self.directions(layer, key.shape[-1], key.device)
        flipped = 0
        for x, up in ((key, up_key), (value, up_value)):
            own, _ = quantise(x, self.kind)
            recorded, _ = quantise(x, self.kind, up)
            differs = own.float() != recorded.float()  # [B, Hkv, T, D]; the codes are finite (clamped), never NaN
            flipped += int((differs & visible[..., None]).sum())
        return flipped
