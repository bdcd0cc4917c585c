"""Optimizer offload (`optim.offload`): the trainable state moves to host memory while the rollout runs, and back for
the learner, as verl's optimizer and parameter offload does between its rollout and training phases.

What moves: the float32 master weights (`smd_cli.model.precision.MasterWeights`), their gradients and the optimizer's
state (AdamW's two moments and step). A float32 model is its own master and the rollout reads it, so there only
the gradients and the optimizer's state move. The rollout then holds the compute-dtype weights alone: for
Qwen3-4B in bf16, 8 GiB instead of 67 GiB (masters 16, their gradients 16, AdamW 32), which is what lets the
paper's long-prompt recipes decode on an 80 GiB card (`smd plan` prints the fit both ways).

Each tensor is copied into a host buffer (pinned on CUDA, so the copies are asynchronous; allocated once and
reused), its device storage released, and later copied into a fresh device tensor. The master parameters keep
their identity (their `.data` moves), so the optimizer's state, keyed by parameter, and the gradient hooks stay
valid; the values come back bit for bit. On the CPU the same copies run between two host tensors (pinned memory
needs CUDA): the CPU path is the CUDA path's faithful twin apart from pinning, and a run with offload trains
exactly what a run without does (tested). The cost is the transfer, both ways at every step: 16 bytes per
parameter (64 GB for 4B) over PCIe.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class Offload:
    """The trainable state of `optimizer` (a `MasterWeights` or any torch optimizer), moved off `device` and back."""

    def __init__(self, optimizer, device: torch.device):
        self.optimizer = optimizer
        self.pinned = torch.device(device).type == "cuda"
        self.host: dict[tuple, torch.Tensor] = {}  # (kind, index, name) -> host buffer, reused at every step
        self.moved: dict[tuple, torch.device] = {}  # what is on the host now, and the device it came from

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _masters(self) -> bool:
        return hasattr(self.optimizer, "pairs")  # MasterWeights: the parameters it optimizes are its own float32 masters

    def _to_host(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.host.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = self.pinned and tensor.is_cuda
            buffer = self.host[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        self.moved[key] = tensor.device
        return buffer.copy_(tensor, non_blocking=buffer.is_pinned())

    def _to_device(self, key: tuple) -> torch.Tensor:
        buffer = self.host[key]
        return torch.empty(buffer.shape, dtype=buffer.dtype, device=self.moved.pop(key)).copy_(buffer, non_blocking=buffer.is_pinned())

    def tensors(self) -> dict[tuple, torch.Tensor]:
        """Every tensor that moves, by key (what the tests compare before and after)."""
        out = {}
        for i, p in enumerate(self._params()):
            if self._masters():
                out[("master", i, "")] = p.data
            if p.grad is not None:
                out[("grad", i, "")] = p.grad
            for name, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[("state", i, name)] = value
        return out

    @property
    def away(self) -> bool:
        return bool(self.moved)

    @torch.no_grad()
    def to_host(self) -> None:
        """Copy the state to host memory and release its device storage."""
        if self.away:
            return
        masters, state = self._masters(), self.optimizer.state
        for i, p in enumerate(self._params()):
            if masters:
                p.data = self._to_host(("master", i, ""), p.data)
            if p.grad is not None:
                host = self._to_host(("grad", i, ""), p.grad)
                p.grad = host if masters else None  # a master's beside it on the host; a device parameter's kept aside
            for name, value in list(state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    state[p][name] = self._to_host(("state", i, name), value)
        if self.pinned:
            torch.cuda.synchronize()  # the host copies are complete before the rollout reuses the memory they came from

    @torch.no_grad()
    def to_device(self) -> None:
        """Copy the state back into fresh tensors on the devices it came from (bit for bit what the learner left)."""
        if not self.away:
            return
        masters, state = self._masters(), self.optimizer.state
        for i, p in enumerate(self._params()):
            if masters:
                p.data = self._to_device(("master", i, ""))
            if ("grad", i, "") in self.moved:
                p.grad = self._to_device(("grad", i, ""))
            for name, value in list(state.get(p, {}).items()):
                if ("state", i, name) in self.moved:
                    state[p][name] = self._to_device(("state", i, name))


@contextmanager
def offloaded(offload: Offload | None):
    """`with offloaded(offload): rollout`: the state on the host for the duration (nothing when `offload` is None)."""
    if offload is None:
        yield
        return
    offload.to_host()
    try:
        yield
    finally:
        offload.to_device()
