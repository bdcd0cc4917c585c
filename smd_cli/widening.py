"""A float64 forward of a model without a float64 copy of it: the parity guard's replay (`smd_cli.parity`).

Inside `float64(model)`, every module that holds parameters or buffers of its own computes in float64 while its own
forward runs, and only then: a forward pre-hook swaps float64 copies of its tensors in, a forward hook puts the
originals back. So at most one module's float64 copy exists at a time (one projection, or one layer's experts), never
the model's (a float64 copy of a float32 model is twice its size: 32 GB for a 4B model). The vocabulary-sized tensors
are never copied whole: an `nn.Embedding` looks its rows up in its own dtype and widens them (exact: the same values),
and the output embedding (the LM head) multiplies in float64 HEAD_ROWS rows of its weight at a time. A mixture of
experts runs transformers' "eager" experts loop meanwhile (the grouped matmul kernel has no float64 mode).

The model's own tensors are never touched: the same storages, dtypes and values afterwards, so the optimizer's state,
tied weights and CUDA graphs that captured them stay valid. The logits equal those of `copy.deepcopy(model).double()`
to float64 rounding (tests/test_parity_guard.py). Gradients are off inside; a module whose tensors another module reads
directly (not through its own forward) would meet float64 activations with its float32 tensors and fail loudly.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

HEAD_ROWS = 4096  # vocabulary rows of the LM head widened at once (4096 x 2560 x 8 bytes = 80 MiB at Qwen3-4B's width)


def _own_tensors(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(store, name) of the floating-point parameters and buffers `module` holds itself (not its children's)."""
    return [(store, name) for store in (module._parameters, module._buffers)
            for name, tensor in store.items() if tensor is not None and tensor.is_floating_point()]


def _swap_in(module: torch.nn.Module, args) -> None:
    module._smd_narrow = [(store, name, store[name]) for store, name in _own_tensors(module)]
    for store, name, tensor in module._smd_narrow:
        store[name] = tensor.detach().double()


def _swap_out(module: torch.nn.Module, args, output) -> None:
    for store, name, tensor in module.__dict__.pop("_smd_narrow", ()):
        store[name] = tensor


def _widened(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.double()


def _wide_head(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's logits in float64, [..., V]: a slice of HEAD_ROWS vocabulary rows widened at a time."""
    weight, bias, x = head.weight, head.bias, hidden.double()
    return torch.cat([F.linear(x, weight[i : i + HEAD_ROWS].double(), None if bias is None else bias[i : i + HEAD_ROWS].double())
                      for i in range(0, weight.shape[0], HEAD_ROWS)], dim=-1)


@contextmanager
def float64(model: torch.nn.Module):
    """`model` computing in float64, one module's tensors widened at a time (see the module), without gradient."""
    head = model.get_output_embeddings()
    handles = []
    for module in model.modules():
        if module is head or not _own_tensors(module):
            continue
        if isinstance(module, torch.nn.Embedding):
            handles.append(module.register_forward_hook(_widened))
        else:
            handles.append(module.register_forward_pre_hook(_swap_in))
            handles.append(module.register_forward_hook(_swap_out, always_call=True))
    if head is not None:
        head.forward = lambda hidden: _wide_head(head, hidden)  # this instance only, for the duration
    experts = _eager_experts(model)
    try:
        with torch.no_grad():
            yield model
    finally:
        for handle in handles:
            handle.remove()
        if head is not None:
            del head.forward
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
