"""A float64 forward of a model without a float64 copy of it: the parity guard's replay (`smd_cli.checks.parity`).

Inside `float64(model)` the model computes in float64 one piece at a time: each decoder layer (with everything inside
it) and each other module that holds parameters or buffers of its own swaps float64 copies of its tensors in for the
duration of its own forward, and the originals back after it. So at most one decoder layer's float64 copy exists at a
time, never the model's (a float64 copy of a float32 model is twice its size: 32 GB for a 4B model). A whole layer is
one piece because a module may read another's tensors inside it (HunYuan-MoE's gate reads its router's dtype). The
vocabulary-sized tensors are never copied whole: an `nn.Embedding` looks its rows up in its own dtype and widens them
(exact: the same values), and the output embedding (the LM head) multiplies in float64 HEAD_ROWS rows of its weight
at a time. A mixture of experts runs transformers' "eager" experts loop meanwhile (the grouped matmul kernel has no
float64 mode). The pieces' `forward` is replaced on the instance for the duration, so a layer called through
`layer.forward(...)` (SMD's shared-prompt passes) is widened as well as one called as `layer(...)`.

The model's own tensors are never touched: the same storages, dtypes and values afterwards, so the optimizer's state,
tied weights and CUDA graphs that captured them stay valid. The log-probs equal those of `copy.deepcopy(model).double()`
bit for bit (measured on a tiny model of every allow-listed family; tests/test_parity_guard.py holds the tiny Qwen3,
Mixtral and HunYuan-MoE to it). Gradients are off.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers.modeling_layers import GradientCheckpointingLayer

HEAD_ROWS = 4096  # vocabulary rows of the LM head widened at once (4096 x 2560 x 8 bytes = 80 MiB at Qwen3-4B's width)


def _own_tensors(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(store, name) of the floating-point parameters and buffers `module` holds itself (not its children's)."""
    return [(store, name) for store in (module._parameters, module._buffers)
            for name, tensor in store.items() if tensor is not None and tensor.is_floating_point()]


def _swapping(piece: torch.nn.Module, forward):
    """`forward` run with float64 copies of the tensors of `piece` and everything inside it, the originals put back."""
    def wide(*args, **kwargs):
        narrow = [(store, name, store[name]) for module in piece.modules() for store, name in _own_tensors(module)]
        for store, name, tensor in narrow:
            store[name] = tensor.detach().double()
        try:
            return forward(*args, **kwargs)
        finally:
            for store, name, tensor in narrow:
                store[name] = tensor
    return wide


def _wide_head(head: torch.nn.Module):
    """The LM head's logits in float64, [..., V]: a slice of HEAD_ROWS vocabulary rows widened at a time."""
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias, x = head.weight, head.bias, hidden.double()
        return torch.cat([F.linear(x, weight[i : i + HEAD_ROWS].double(), None if bias is None else bias[i : i + HEAD_ROWS].double())
                          for i in range(0, weight.shape[0], HEAD_ROWS)], dim=-1)
    return forward


def _widened_output(forward):
    return lambda *args, **kwargs: forward(*args, **kwargs).double()


def _pieces(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(module, its float64 forward) for every piece of `model` (see the module)."""
    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    inside = {id(m) for layer in layers for m in layer.modules()}
    pieces = [(layer, _swapping(layer, layer.forward)) for layer in layers]
    for module in model.modules():
        if id(module) in inside or not _own_tensors(module):
            continue
        if module is head:
            pieces.append((module, _wide_head(module)))
        elif isinstance(module, torch.nn.Embedding):
            pieces.append((module, _widened_output(module.forward)))
        else:
            pieces.append((module, _swapping(module, module.forward)))
    return pieces


@contextmanager
def float64(model: torch.nn.Module):
    """`model` computing in float64, one piece's tensors widened at a time (see the module), without gradient."""
    pieces = _pieces(model)
    for module, forward in pieces:
        module.forward = forward  # this instance only, for the duration
    experts = _eager_experts(model)
    try:
        with torch.no_grad():
            yield model
    finally:
        for module, _ in pieces:
            del module.forward
        for config, implementation in experts:
            config._experts_implementation = implementation


def _eager_experts(model: torch.nn.Module) -> list[tuple[object, str]]:
    """Set every config of `model` that picks a mixture of experts' kernel to transformers' "eager" loop (its grouped
    matmul has no float64 mode); returns (config, its kernel) to put back."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    found = [(c, c._experts_implementation) for c in configs.values() if getattr(c, "_experts_implementation", None) not in (None, "eager")]
    for config, _ in found:
        config._experts_implementation = "eager"
    return found
