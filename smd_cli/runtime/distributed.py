"""Data parallelism over `torchrun`'s processes: the process group, reductions, FSDP2 sharding, full state dicts.

One process is the default and everything here is then a no-op: `size() == 1`, reductions return their input,
`shard` returns the model as it is. Under `torchrun` (WORLD_SIZE > 1 in the environment) `init` joins the
process group (NCCL on CUDA, one device per local rank; gloo on the CPU), and a training step's prompt groups
are split across ranks in whole groups (`rank_slice`): each rank rolls out its groups and records their shadow
masks, and the learner is sharded with FSDP2 (`fully_shard` on every decoder layer and on a root `LearnerPass`
that runs the learner's whole forward, so that the embeddings, the final norm and the LM head, which the
learner reads outside the decoder layers, are gathered for it and their gradients reduced after it).

Every quantity the learner normalises by or logs is global: token and sequence counts, Sparse-RL's mean
weight, the mismatch statistics (`total`, `largest`), so that N processes compute the loss and the metrics
of the one-process batch. The gradient is the sum of the ranks' (FSDP's averaging is undone by the divide
factor 1). Rollouts run on unsharded weights (`gathered`): ranks decode different numbers of steps, so no
collective may run per forward.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: one process, no process group


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher) as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device) -> World:
    """Join the process group torchrun describes in the environment (idempotent); World() for one process.

    On CUDA each process takes the device of its local rank and NCCL; on the CPU, gloo."""
    if not launched():
        return World()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return world()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world() -> World:
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), local_rank(), dist.get_backend())


def size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def _all_reduced(value, op):
    """`value` (a number or tensor) reduced over the ranks with `op`, in float64, returned as it came."""
    if size() == 1:
        return value
    tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value, dtype=torch.float64).clone()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op)
    if isinstance(value, torch.Tensor):
        return moved.to(dtype=value.dtype, device=value.device)
    return float(moved) if moved.dim() == 0 else moved.cpu()


def total(value):
    """The sum over ranks of a number or tensor (the value itself for one process)."""
    return _all_reduced(value, dist.ReduceOp.SUM)


def largest(value):
    """The maximum over ranks (as `total`)."""
    return _all_reduced(value, dist.ReduceOp.MAX)


def mean_over(values):
    """The mean of a tensor's entries over every rank's `values` (0 when there are none)."""
    count = total(float(values.numel()))
    return total(float(values.double().sum())) / count if count else 0.0


def max_over(values):
    """The largest entry over every rank's `values` (-inf when there are none)."""
    return largest(float(values.max()) if values.numel() else float("-inf"))


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order ([obj] for one process)."""
    if size() == 1:
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def from_main(fn, *args, **kwargs):
    """Run `fn` on rank 0 only and hand its result (or its exception, raised everywhere) to every rank: file
    work that must happen once (locking, verifying and moving checkpoints)."""
    if size() == 1:
        return fn(*args, **kwargs)
    box = [None]
    if is_main():
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except Exception as err:  # every rank stops with the same error, instead of waiting for rank 0
            box[0] = ("error", err)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def barrier() -> None:
    if size() > 1:
        dist.barrier()


def rank_slice(count: int) -> slice:
    """This rank's contiguous share of a step's `count` prompt groups: equal shares, in order."""
    n = size()
    if count % n:
        raise ValueError(f"{count} prompt groups are not divisible by the {n} processes: each rank takes an equal share")
    share = count // n
    return slice(rank() * share, (rank() + 1) * share)


class LearnerPass(torch.nn.Module):
    """The FSDP2 root: `forward(fn, *args)` returns `fn(model, *args)`, so the learner's whole pass (embeddings,
    decoder layers, final norm, LM head over the vocabulary in chunks) runs inside one root forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        out = fn(self.model, *args, **kwargs)
        # views are cloned (small [N, R] tensors): FSDP's pre-backward hook on a view would not survive an in-place op
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t, out)


def shard(model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None = None) -> LearnerPass | None:
    """Shard `model` in place with FSDP2 over all ranks (None for one process): every decoder layer, then a
    `LearnerPass` root over it. `param_dtype` computes in that dtype over float32 weights, gradients reduced
    in float32 (FSDP's MixedPrecisionPolicy)."""
    if size() == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (size(),))
    # forward inputs are left alone: they are already in the compute dtype (the embedding's output), and the smd
    # attention's arguments (`RolloutState`, `PromptTap`, `Replay`) must reach it as they are, not copied by a cast
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None, cast_forward_inputs=False)
    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        setattr(layer, LAYER_PASS, _call)
        register_fsdp_forward_method(layer, LAYER_PASS)  # `layer_pass`: one gather for all of a pass's calls of the layer
    root = fully_shard(LearnerPass(model), mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    # Backward prefetches the layer below, explicitly: FSDP2's implicit choice reads the order of every forward since the
    # last backward, rollouts and no-grad passes included, and re-gathered a layer that had just been freed
    layers = list(model.base_model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_backward_prefetch([layers[i - 1] if i else layer])  # layer 0: itself, already gathered (no-op)
    root.set_modules_to_backward_prefetch([layers[-1]])
    root.compute_dtype = param_dtype  # None: float32 compute
    for module in _fsdp_modules(root):
        module.set_gradient_divide_factor(1.0)  # each rank's loss carries the global normalisers: sum the gradients
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    root(lambda m: None)  # the root's lazy initialisation, before any layer runs on its own in a rollout
    _resharded(root)  # the sharded parameters registered again: the optimizer is built on them
    return root


LAYER_PASS = "smd_layer_pass"


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def layer_pass(layer: torch.nn.Module, fn, *args, **kwargs):
    """`fn(layer, *args, **kwargs)`: every call that one pass of the learner makes of one decoder layer (the prompt
    rows, then each view's response rows), run as one forward of that layer. `fn` calls `layer.forward`, which
    skips module hooks but keeps transformers' gradient checkpointing. Under FSDP2 (`shard` registers the method)
    the layer's weights are then gathered once for the pass and once for its backward, and its gradients
    reduced once, instead of at every call (`reshard_after_forward` would free them between calls); tensors that
    need a gradient go in `args`, so that FSDP knows when the pass's backward is over. One process: `fn` as is."""
    run = getattr(layer, LAYER_PASS, None)
    return fn(layer, *args, **kwargs) if run is None else run(fn, layer, *args, **kwargs)


def _fsdp_modules(root) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(root: LearnerPass | None):
    """Full weights on every rank for the duration (rollouts, evaluation): ranks decode different numbers of
    steps, so no forward may all-gather; resharded afterwards."""
    if root is None:
        yield
        return
    modules = _fsdp_modules(root)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        _resharded(root)
        for module in modules:
            module.set_reshard_after_forward(module is not root, recurse=False)


def _resharded(root) -> None:
    """Every FSDP module's sharded parameters registered (the root keeps its gathered ones after a forward)."""
    for module in _fsdp_modules(root):
        module.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_model_state(root: LearnerPass) -> dict[str, torch.Tensor]:
    """The wrapped model's full state dict on rank 0's CPU (empty on the other ranks), named as the model's own
    `state_dict()`. Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _resharded(root)
    state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    own = {name for name, _ in root.named_parameters()} | {name for name, _ in root.named_buffers()}  # a tied weight once
    return {name.removeprefix("model."): value for name, value in state.items() if name in own}


def full_states(root: LearnerPass, optimizer) -> tuple[dict, dict]:
    """(model weights, optimizer state) gathered on rank 0 in a one-process run's checkpoint layout (empty dicts on
    the other ranks; collective): the optimizer's parameters numbered in the order of `model.parameters()`, and
    for bf16 compute the weights in bf16 with the float32 shards as `MasterWeights`' masters beside the optimizer
    state, so that any number of processes resumes the checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = full_model_state(root)
    named = get_optimizer_state_dict(root, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not named:  # the full states live on rank 0, the one that writes them
        return {}, {}
    names = [name for name, _ in _trainable_names(root)]
    index = {name: i for i, name in enumerate(names)}
    state = {"state": {index[name]: value for name, value in named["state"].items()},
             "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in named["param_groups"]]}
    if root.compute_dtype is None:
        return weights, state
    masters = [weights[name.removeprefix("model.")] for name in names]
    return in_compute_dtype(root, weights), {"optimizer": state, "masters": masters}


def in_compute_dtype(root: LearnerPass, weights: dict) -> dict:
    """Full float32 weights as a one-process run saves them: in the compute dtype (bf16 compute), else as they are."""
    if root.compute_dtype is None:
        return weights
    return {k: v.to(root.compute_dtype) if v.is_floating_point() else v for k, v in weights.items()}


def load_full_states(root: LearnerPass, optimizer, state: dict) -> None:
    """Load a one-process checkpoint's optimizer state (`full_states`' layout; with float32 masters, those
    into the shards first) into a sharded model and optimizer. Every rank passes the same `state`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    names = [name for name, _ in _trainable_names(root)]
    if "masters" in state:
        set_model_state_dict(root, dict(zip(names, state["masters"])), options=StateDictOptions(full_state_dict=True, strict=False))
        state = state["optimizer"]
    named = {"state": {names[i]: value for i, value in state["state"].items()},
             "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]}
    set_optimizer_state_dict(root, optimizer, named, options=StateDictOptions(full_state_dict=True))


def _trainable_names(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]
