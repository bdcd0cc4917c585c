"""Run by tests/test_fsdp_traffic.py under `torchrun --nproc_per_node=2` (gloo, CPU): FSDP2's all-gathers and
reduce-scatters per decoder layer during one `learner_step`, for naive_sparse and smd, on GRPO batches (G samples
of each prompt: `shared_prompt_views`) and on distinct prompts, with gradient checkpointing (on and off for GRPO batches). Rank 0
writes the counts as JSON to argv[1]."""

import json
import sys
from collections import Counter

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer, enable_checkpointing
from smd_cli.model.precision import build_optimizer
from smd_cli.rollout.sampler import generate
from smd_cli.runtime import distributed

GATHERS, REDUCES = Counter(), Counter()
COUNTING = [False]


def _counted_unshard(unshard):
    def wrapper(self, async_op: bool = False):
        before = self._all_gather_result is None and not self.is_unsharded
        unshard(self, async_op)
        if COUNTING[0] and before and self._all_gather_result is not None:
            GATHERS[self._module_fqn] += 1
    return wrapper


def _counted_reduce(reduce):
    def wrapper(fsdp_params, *args, **kwargs):
        if COUNTING[0]:
            REDUCES[id(fsdp_params[0])] += 1
        return reduce(fsdp_params, *args, **kwargs)
    return wrapper


fsdp_group.FSDPParamGroup.unshard = _counted_unshard(fsdp_group.FSDPParamGroup.unshard)
fsdp_group.foreach_reduce = _counted_reduce(fsdp_group.foreach_reduce)


def one_step(name: str, grouped: bool, checkpointing: bool) -> dict:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=0).eval()
    if checkpointing:
        enable_checkpointing(model)
    root = distributed.shard(model, torch.device("cpu"))
    optimizer = build_optimizer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    generator = torch.Generator().manual_seed(distributed.rank())
    distinct = [torch.randint(3, len(tokenizer), (40 - 3 * i,), generator=generator).tolist() for i in range(4)]
    prompts = [p for p in distinct[:2] for _ in range(2)] if grouped else distinct  # 4 rows per rank
    with distributed.gathered(root):
        batch = generate(model, prompts, policy=SnapKV(0.5, sink=2, window=4), max_new_tokens=5,
                         generator=torch.Generator().manual_seed(7 + distributed.rank()), eos_token_id=-1, pad_token_id=0)
    GATHERS.clear(), REDUCES.clear()
    COUNTING[0] = True
    learner_step(root, optimizer, batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), Algorithm(name, max_grad_norm=1e9))
    COUNTING[0] = False
    layers = {fqn: n for fqn, n in GATHERS.items() if fqn and ".layers." in fqn}
    return {"gathers_per_layer": layers, "other_gathers": {fqn or "root": n for fqn, n in GATHERS.items() if fqn not in layers},
            "reduce_scatters": sum(REDUCES.values()), "layers": model.config.num_hidden_layers}


def main() -> None:
    distributed.init(torch.device("cpu"))
    torch.set_num_threads(1)
    out = {}
    for name in ("naive_sparse", "smd"):
        for grouped, checkpointing in ((True, True), (True, False), (False, True)):
            out[f"{name}/{'grouped' if grouped else 'distinct'}/{'checkpointing' if checkpointing else 'plain'}"] = \
                one_step(name, grouped, checkpointing)
    if distributed.is_main():
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)
    distributed.barrier()


if __name__ == "__main__":
    main()
