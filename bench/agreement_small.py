"""Does the agreement's lower tail predict what eviction costs? (issue 29 item 2, eval only: no training.)

For every eviction policy x compression, on held-out prompts of the small scale (SmolLM2-135M-Instruct on passkey,
`scale=small`): samples G responses per prompt under the evicting cache (temperature `--temperature`, as GRPO's
rollouts do) and reports the per-token agreement of the sampler with the dense policy (`smd_cli.learner.agreement`: p5,
p50, mean over the sampled tokens) beside the reward of those samples and the greedy held-out reward under the
same eviction (what `smd train`'s eval/evict/reward measures at the small scale), and the KV kept. A first row,
eviction=none, is the dense cache (agreement 1).

Usage:
  python bench/agreement_small.py [--policies snapkv,h2o,recent,random,knorm] [--compressions 0.3,0.5,0.7,0.9]
                                  [--prompts 16] [--samples 4] [--json out.json] [OVERRIDE ...]
  python bench/agreement_small.py --quick        # the tiny model, 2 policies x 2 compressions, 2 prompts: a smoke run
Extra arguments are Hydra overrides of `smd train`'s config (e.g. task.prompt_tokens=300). The model loads once.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from smd_cli.cli import CONF_DIR
from smd_cli.config.factories import build_policy, build_task
from smd_cli.config.prompts import encode_prompt, load_examples
from smd_cli.learner import agreement
from smd_cli.rollout.sampler import generate, response_texts
from smd_cli.runs.model_loading import load_model
from smd_cli.runs.run_dirs import pick_device
from smd_cli.runtime.integrity import write_file

POLICIES = "snapkv,h2o,recent,random,knorm"
COMPRESSIONS = "0.3,0.4,0.5,0.6,0.7,0.8,0.9"
QUICK = ["scale=tiny", "model.warmstart.steps=5", "task.prompt_tokens=48"]


def cell(model, tokenizer, task, examples, cfg, policy_name: str, compression: float, samples: int, temperature: float) -> dict:
    """One policy at one compression: sampled rollouts (agreement, reward) and greedy ones (reward), seeded."""
    at = copy.deepcopy(cfg)
    with open_dict(at):
        at.compression = compression
    policy = None if policy_name == "none" else build_policy(at, policy_name)
    eos, pad, max_new = tokenizer.eos_token_id, tokenizer.pad_token_id, int(cfg.sampling.max_new_tokens)
    prompts = [encode_prompt(task, e, tokenizer) for e in examples]
    repeated = [p for p in prompts for _ in range(samples)]
    started = time.perf_counter()
    batch = generate(model, repeated, policy=policy, max_new_tokens=max_new, temperature=temperature,
                     generator=torch.Generator().manual_seed(cfg.seed), eos_token_id=eos, pad_token_id=pad, measure_dense_kv=False)
    sampled = [float(task.reward(t, e)) for t, e in zip(response_texts(batch, tokenizer), [e for e in examples for _ in range(samples)])]
    values = agreement.measure(model, batch, temperature, backend=cfg.model.replay)
    dense = {f"agreement/{k}": 1.0 for k in ("p5", "p50", "mean", "min")}  # no eviction: the sampler is the dense policy
    found = dense if values is None else agreement.summary(values)
    policy = None if policy_name == "none" else build_policy(at, policy_name)  # fresh: the same random choices
    greedy = generate(model, prompts, policy=policy, max_new_tokens=max_new, temperature=0.0, eos_token_id=eos, pad_token_id=pad,
                      measure_dense_kv=False)
    greedy_reward = [float(task.reward(t, e)) for t, e in zip(response_texts(greedy, tokenizer), examples)]
    return {"policy": policy_name, "compression": compression if policy_name != "none" else 0.0, **found,
            "reward_sampled": sum(sampled) / len(sampled), "reward_greedy": sum(greedy_reward) / len(greedy_reward),
            "kv_kept": batch.stats["kv/kept_fraction"], "tokens": int(batch.response_mask.sum()), "seconds": time.perf_counter() - started}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--compressions", default=COMPRESSIONS)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (the task's test split)")
    ap.add_argument("--samples", type=int, default=4, help="sampled responses per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="the tiny model, snapkv and random at 0.5 and 0.9, 2 prompts x 2 samples")
    ap.add_argument("--json", type=Path, default=None)
    args, overrides = ap.parse_known_args(argv)
    if args.quick:
        args.policies, args.compressions, args.prompts, args.samples = "snapkv,random", "0.5,0.9", 2, 2
    base = QUICK if args.quick else ["scale=small"]
    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*base, "progress=false", *overrides])
    task, device = build_task(cfg), pick_device(cfg)
    model, tokenizer = load_model(cfg, task, device, progress=False)
    examples = load_examples(task, task.test_split, args.prompts)
    rows = [cell(model, tokenizer, task, examples, cfg, "none", 0.0, args.samples, args.temperature)]
    for name in args.policies.split(","):
        for c in (float(x) for x in args.compressions.split(",")):
            rows.append(cell(model, tokenizer, task, examples, cfg, name, c, args.samples, args.temperature))
            print(f"{name} c={c:g}: p5 {rows[-1]['agreement/p5']:.4f} mean {rows[-1]['agreement/mean']:.4f} "
                  f"greedy reward {rows[-1]['reward_greedy']:.3f}", file=sys.stderr, flush=True)
    columns = ("agreement/p5", "agreement/p50", "agreement/mean", "reward_sampled", "reward_greedy", "kv_kept", "seconds")
    print(f"model {cfg.model.name}, task {task.name}, {args.prompts} held-out prompts x {args.samples} samples at T={args.temperature:g}"
          " (greedy reward: one per prompt)")
    print("| policy | compression | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for r in rows:
        print(f"| {r['policy']} | {r['compression']:g} | " + " | ".join(f"{r[c]:.4g}" for c in columns) + " |")
    if args.json:
        write_file(args.json, json.dumps({"argv": argv if argv is not None else sys.argv[1:], "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
