"""Each algorithm's training step against naive sparse's on the same batch (DESIGN.md contract 5: SMD <= 1.10x).

Usage: python bench/step_overhead.py [--layers 4 --hidden 256 --prompt 512 --rows 8 --group 1 --reps 3] [--json out.json]
       python bench/step_overhead.py --model smollm2_135m --prompt 227 --response 12 --rows 16 --group 4   (a real model)
(measured: SMD / naive_sparse 1.040 at these defaults and 1.074 at --hidden 128 --prompt 256 --rows 16; see
results/PERFORMANCE.md)
Every algorithm does one rollout (SnapKV, c = 0.5; dense: no eviction) and one learner step on it from the
same weights. `--group G`: the rows are G samples of each prompt, as in GRPO, so the prefill and the learner
compute each prompt once and the response rows (where SMD's teacher and KL add their work) weigh more. Steps alternate between the algorithms round by round and the medians are compared, so drift
in the machine's load hits all alike; each round's ratio is kept too (the spread over rounds is the noise).
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.losses import group_advantages
from smd_cli.learner.step import ALGORITHMS, Algorithm, learner_step
from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer
from smd_cli.rollout.sampler import generate
from smd_cli.runtime.integrity import write_file


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--group", type=int, default=1, help="rows per prompt (GRPO's G; >1: the rows of a group share their prompt)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--algos", default="naive_sparse,smd", help=f"comma-separated, from {','.join(ALGORITHMS)}")
    ap.add_argument("--model", default=None, help="a model config (conf/model/NAME.yaml), e.g. smollm2_135m; default: random widths")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    names = args.algos.split(",")
    if "naive_sparse" not in names or not set(names) <= set(ALGORITHMS):
        ap.error(f"--algos must include naive_sparse (the reference) and name only {', '.join(ALGORITHMS)}")
    torch.set_num_threads(args.threads)
    weights = None
    if args.model:
        from decode_speed import load_named  # bench/decode_speed.py, beside this script

        base, vocab, weights = load_named(args.model)
    else:
        vocab = len(build_tiny_tokenizer())
        base = build_tiny_model(vocab, seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                                intermediate_size=3 * args.hidden, head_dim=args.hidden // 4).eval()
    if args.rows % args.group:
        ap.error(f"--rows {args.rows} must be a multiple of --group {args.group}")
    distinct = torch.randint(3, vocab, (args.rows // args.group, args.prompt), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [p for p in distinct for _ in range(args.group)]
    policy = SnapKV(compression=0.5)
    advantages = group_advantages(torch.randn(args.rows, generator=torch.Generator().manual_seed(1)), max(args.group, 2))
    times = {name: [] for name in names}
    for rep in range(args.reps + 1):  # the first round warms up
        for name in names:
            model = copy.deepcopy(base)
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            t0 = time.perf_counter()
            batch = generate(model, prompts, policy=None if name == "dense" else policy, max_new_tokens=args.response,
                             temperature=1.0, generator=torch.Generator().manual_seed(rep), eos_token_id=-1, pad_token_id=0,
                             measure_dense_kv=False)
            learner_step(model, optimizer, batch, advantages, Algorithm(name))
            if rep:
                times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ref = medians["naive_sparse"]
    described = weights or f"{args.layers} layers, hidden {args.hidden}"
    print(f"model: {described}; batch {args.rows} x (P {args.prompt} + R {args.response}), "
          f"{args.group} row(s) per prompt; {args.reps} reps, {args.threads} thread(s)")
    for name in names:
        rounds = [t / r for t, r in zip(times[name], times["naive_sparse"])]
        print(f"{name:13s} step (rollout + learner): median {medians[name]:.3f} s, / naive_sparse {medians[name] / ref:.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in rounds)})")
    if "smd" in names:
        print(f"smd / naive_sparse = {medians['smd'] / ref:.3f}  (contract: <= 1.10, target < 1.05)")
    result = {"args": vars(args) | {"json": None}, "weights": weights, "seconds": times, "median_seconds": medians,
              "over_naive_sparse": {n: medians[n] / ref for n in names},
              "rounds_over_naive_sparse": {n: [t / r for t, r in zip(times[n], times["naive_sparse"])] for n in names}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
