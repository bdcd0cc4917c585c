"""SMD's training step against naive sparse's on the same batch (DESIGN.md contract 5: <= 1.10x, target 1.05x).

Usage: python bench/step_overhead.py [--layers 4 --hidden 256 --prompt 512 --rows 8 --reps 3]
(measured: 1.007 at these defaults; 1.13 at --hidden 128 --prompt 256 --rows 16, where fixed per-op
costs of building the masks outweigh attention; see results/overhead_memory_tiny.md)
Both algorithms do one evicting rollout (SnapKV, c = 0.5) and one learner step on it; SMD's learner runs
the shadow-mask forward with gradients plus a no-grad dense teacher, naive sparse a dense forward with
gradients plus a no-grad dense pi_old recompute. Steps alternate between the two algorithms (same
weights each time) and the medians are compared, so drift in the machine's load hits both alike.
"""

import argparse
import copy
import statistics
import time

import torch

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner import Algorithm, learner_step
from smd_cli.losses import group_advantages
from smd_cli.models import build_tiny_model, build_tiny_tokenizer
from smd_cli.rollout import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = build_tiny_tokenizer()
    base = build_tiny_model(len(tok), seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                            intermediate_size=3 * args.hidden, head_dim=args.hidden // 4).eval()
    prompts = torch.randint(3, len(tok), (args.rows, args.prompt), generator=torch.Generator().manual_seed(0)).tolist()
    policy = SnapKV(compression=0.5)
    advantages = group_advantages(torch.randn(args.rows, generator=torch.Generator().manual_seed(1)), 4)
    times = {"naive_sparse": [], "smd": []}
    for rep in range(args.reps + 1):  # the first round warms up
        for name in times:
            model = copy.deepcopy(base)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            t0 = time.perf_counter()
            batch = generate(model, prompts, policy=policy, max_new_tokens=args.response, temperature=1.0,
                             generator=torch.Generator().manual_seed(rep), eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
            learner_step(model, optimizer, batch, advantages, Algorithm(name))
            if rep:
                times[name].append(time.perf_counter() - t0)
    naive, smd = statistics.median(times["naive_sparse"]), statistics.median(times["smd"])
    print(f"model: {args.layers} layers, hidden {args.hidden}; batch {args.rows} x (P {args.prompt} + R {args.response}); "
          f"{args.reps} reps, {args.threads} thread(s)")
    print(f"naive_sparse step (rollout + learner): median {naive:.3f} s")
    print(f"smd step          (rollout + learner): median {smd:.3f} s")
    print(f"smd / naive_sparse = {smd / naive:.3f}  (contract: <= 1.10, target < 1.05)")


if __name__ == "__main__":
    main()
