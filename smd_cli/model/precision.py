"""Mixed precision as the field runs it: compute in bf16, train float32 master weights.

A model whose `model.dtype` is bfloat16 (or float16) computes in that dtype everywhere: the rollout, the
dense teacher and the learner's forward and backward read the same low-precision weights, which keeps SMD's
parity in bf16 down to kernel rounding. Its trainable state lives in float32 beside it (`MasterWeights`):
a master copy of every trainable weight, the master's gradient, and the optimizer, built on the masters.
Each bf16 gradient is added into its master's float32 gradient as soon as backward has produced it (a
post-accumulate-grad hook) and freed, so micro-batches accumulate in float32 and no bf16 gradient outlives
its layer; `step` updates the masters and copies them, rounded, into the model.

Why: at lr 1e-6 an Adam update of a weight near 0.02 is about 1e-6, far below bf16's spacing there (1.2e-4),
so a bf16 weight updated in place never moves. The master moves at every step, and the bf16 copy follows
once the accumulated change crosses half a spacing. FSDP's `MixedPrecisionPolicy` and DeepSpeed's bf16
optimizer keep the same three float32 tensors per weight.
"""

from __future__ import annotations

from typing import Callable

import torch


class MasterWeights:
    """An optimizer over float32 masters of `model`'s trainable weights, with the optimizer interface the
    learner and the checkpoints use (`param_groups`, `state`, `zero_grad`, `step`, `state_dict`)."""

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.model = model
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._hooks = []
        for param in model.parameters():
            if not param.requires_grad:
                continue
            master = torch.nn.Parameter(param.detach().float().clone())
            master.grad = torch.zeros_like(master)
            self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulate_into(master)))
            self.pairs.append((param, master))
        self.optimizer = make_optimizer([master for _, master in self.pairs])

    @staticmethod
    def _accumulate_into(master: torch.nn.Parameter):
        def hook(param: torch.Tensor) -> None:
            master.grad.add_(param.grad)  # float32 += bf16, converted element by element (no float32 copy)
            param.grad = None

        return hook

    def close(self) -> None:
        """Detach from the model: its hooks go (each holds a master and its gradient), so another optimizer can be
        built on the same model and this one's float32 state can be freed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the masters' gradients in place (they stay allocated: static memory) and drop any bf16 one."""
        for param, master in self.pairs:
            master.grad.zero_()
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for param, master in self.pairs:
            param.copy_(master)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": [master.detach() for _, master in self.pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        masters = state.get("masters")
        if masters is None or len(masters) != len(self.pairs):
            raise ValueError(f"optimizer state holds {None if masters is None else len(masters)} master weights, "
                             f"the model has {len(self.pairs)} trainable tensors (was it saved with another model.dtype?)")
        for (param, master), saved in zip(self.pairs, masters):
            master.copy_(saved)
            param.copy_(master)
        self.optimizer.load_state_dict(state["optimizer"])


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 among /proc/cpuinfo's flags; False where there
    is no /proc/cpuinfo): there bf16 compute is faster than float32, elsewhere it is emulated and slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_compute_dtype(cpu_dtype: str | None, dtype: str) -> str:
    """The compute dtype on the CPU: `model.cpu_dtype` when set (`auto`: bfloat16 where the CPU has it natively,
    `native_bf16`, else `model.dtype`), or `model.dtype`."""
    if cpu_dtype == "auto":
        return "bfloat16" if native_bf16() else dtype
    return cpu_dtype or dtype


def build_optimizer(model: torch.nn.Module, make_optimizer: Callable):
    """`make_optimizer(params)` over the model's own weights when they are float32, else over float32
    masters (`MasterWeights`)."""
    if next(model.parameters()).dtype == torch.float32:
        return make_optimizer(model.parameters())
    return MasterWeights(model, make_optimizer)
