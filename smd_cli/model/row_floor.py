"""Few-row matmuls on the CPU on the kernel of many-row ones: a floor on the rows of every linear layer.

A decode step multiplies a few rows (one token per sequence) by each weight, and so do the learner's response rows of
a small group; the learner's replay multiplies whole sequences. On the CPU, MKL picks its GEMM kernel by the number of
rows, and the kernels sum in different orders: a row's float32 result is the same in any batch of at least 16 rows and
another one below that (torch 2.13, 1 and 2 threads, all four of SmolLM2's weight shapes, an Intel CPU); on an AMD
EPYC the float32 floor is 4 and float64 rows agree only in batches that are multiples of 4 (a quantum, not a floor).
SmolLM2 decoding 8 rows (2 prompts x 4 samples, `scale=small`) therefore missed the learner's log-probs by up to 3.2e-5 through its 30 layers.
`apply(model)` makes each plain `nn.Linear` a `FlooredLinear`: on the CPU, an input of fewer rows than the floor of its
weight's shape and dtype (`rule_of`: the smallest batch that rounds each row as a large one does, or the multiple of
rows that does, found once, bit for bit, on this machine) is padded with zero rows and the padding dropped after. The rows a layer returns then do not
depend on how many rows it was given, in the sampler and the learner alike. Other devices: `F.linear` as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CANDIDATES = (1, 2, 4, 8, 16, 32)  # row floors tried, smallest first
QUANTA = (2, 4, 8, 16)  # row multiples tried when no floor holds (OpenBLAS / AMD float64: only multiples of 4 agree)
REFERENCE_ROWS = 64  # the batch whose rows every rule must reproduce (the learner's batches are larger)
_RULES: dict[tuple, tuple[int, int]] = {}


def rule_of(weight: torch.Tensor) -> tuple[int, int]:
    """(floor, quantum) for this weight's shape and dtype on this machine, found once, bit for bit against a batch of
    `REFERENCE_ROWS`: a batch of `rows` rounds each row as the large batch does once padded to max(rows, floor) rows
    (quantum 1), or to the next multiple of `quantum` (floor 1). (1, 1): every batch already does, or nothing tried did."""
    key = (tuple(weight.shape), weight.dtype, weight.device.type, torch.get_num_threads())
    if key not in _RULES:
        x = torch.randn(REFERENCE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        with torch.no_grad():
            w = weight.detach()  # the layer's own weight: no copy of a large head
            large = F.linear(x, w)
            same = lambda rows: torch.equal(F.linear(x[:rows], w), large[:rows])  # noqa: E731
            floor = next((c for c in CANDIDATES if same(c) and same(c + 1) and same(c + 3)), None)
            quantum = None if floor else next((q for q in QUANTA if all(same(r) for r in range(q, REFERENCE_ROWS // 2 + 1, q))), None)
            _RULES[key] = (floor, 1) if floor else (1, quantum) if quantum else (1, 1)
    return _RULES[key]


def floor_of(weight: torch.Tensor) -> int:
    """The smallest batch (rows) from which `F.linear` rounds each row as it does in a large batch, for this
    weight's shape and dtype on this machine; 1 when every batch does, or when only multiples of a quantum do."""
    return rule_of(weight)[0]


def padded(rows: int, rule: tuple[int, int]) -> int:
    """The rows a batch of `rows` rows runs as under `rule` ((floor, quantum), `rule_of`)."""
    floor, quantum = rule
    return max(rows, floor) if quantum == 1 else -(-rows // quantum) * quantum


def padded_rows(rows: int, weight: torch.Tensor) -> int:
    """The rows `linear` runs `rows` rows of `weight` as on the CPU (`rule_of`)."""
    return padded(rows, rule_of(weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, its rows computed as in a batch of `padded_rows` rows (CPU)."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows == 0:
        return F.linear(x, weight, bias)
    target = padded_rows(rows, weight)
    if target == rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(target - rows, x.shape[-1])])
    # a copy of the rows asked for, so that the padded output (a [floor, V] logits buffer for a head) is freed at once
    return F.linear(flat, weight, bias)[:rows].clone().reshape(*x.shape[:-1], weight.shape[0])


class FlooredLinear(torch.nn.Linear):
    """An `nn.Linear` whose few-row inputs on the CPU run on the many-row kernel (`linear`); the same parameters,
    state dict and checkpoints (the class is swapped in place)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Make every plain `nn.Linear` of `model` a `FlooredLinear` (idempotent; subclasses such as a `WideLogits` head,
    LoRA or quantised layers keep their own forward), and find the floors of its weights on the CPU now (a [64, out]
    product each, once per shape: at the model's load, not inside a rollout's memory); returns the model."""
    for layer in model.modules():
        if type(layer) is torch.nn.Linear:
            layer.__class__ = FlooredLinear
        if not isinstance(layer, torch.nn.Linear):
            continue
        weight = layer.weight  # a shard (FSDP2's DTensor) is not probed: its forward sees the gathered weight, probed then
        if type(weight.detach()) is torch.Tensor and weight.device.type == "cpu" and weight.is_floating_point():
            rule_of(weight)
    return model
