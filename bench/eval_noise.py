"""How many held-out prompts: the evaluation's cost per prompt, and its noise in a cell and in a paired difference.

Usage: python bench/eval_noise.py [--runs RUN_A RUN_B] [--task vote --seed 0 --prompts 1024] [--json out.json]
Two policies trained from the same warm start (`--runs`: two `smd train` run directories of the same task and seed;
default: SMD and naive sparse, 40 steps each, trained here into a temporary directory) are evaluated on `--prompts`
held-out prompts the way `smd train` does (the same prompts and sampling noise for both; sampled and greedy, with a
dense cache and under SnapKV at c = 0.5). Printed per evaluation: seconds per prompt, the per-prompt standard
deviation of each policy's reward and of the paired difference a - b, and what they make the standard error of a
cell and of a paired difference at 128 to 1024 prompts. `make reproduce` compares two cells seed by seed, so the
paired one is what adds to the spread between seeds (README, "Reproducing the paper": the cost model).
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from smd_cli.cli import CONF_DIR, register_recipes
from smd_cli.evaluation import evaluate
from smd_cli.stages.factories import build_policy, build_task
from smd_cli.stages.model_loading import load_model
from smd_cli.stages.prompts import load_examples

SIZES = (128, 256, 512, 1024)


def train(task: str, seed: int, algo: str, where: Path) -> Path:
    run = where / algo
    subprocess.run([sys.executable, "-m", "smd_cli.cli", "train", f"task={task}", f"seed={seed}", f"algo={algo}", "steps=40",
                    "eval.num_prompts=0", "progress=false", "checkpoint.every=0", f"hydra.run.dir={run}"], check=True,
                   stdout=subprocess.DEVNULL)
    return run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs=2, type=Path, default=None)
    ap.add_argument("--task", default="vote")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    register_recipes()
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or [train(args.task, args.seed, algo, Path(tmp)) for algo in ("smd", "naive_sparse")]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"task={args.task}", f"seed={args.seed}", "progress=false", "device=cpu"])
            task = build_task(cfg)
            _, tokenizer = load_model(cfg, task, torch.device("cpu"), progress=False)
            policy = build_policy(cfg, "snapkv")
        examples = load_examples(task, task.test_split, args.prompts)
        rewards, seconds = {}, {}
        for i, run in enumerate(runs):
            model = AutoModelForCausalLM.from_pretrained(run / "final").eval()
            for view, evicting in (("dense cache", False), ("under eviction", True)):
                for kind, temperature in (("sampled", cfg.eval.temperature), ("greedy", 0.0)):
                    started = time.process_time()
                    rows, _ = evaluate(model, tokenizer, task, examples, max_new_tokens=cfg.sampling.max_new_tokens, batch_size=64,
                                       temperature=temperature, policy=policy if evicting else None, seed=args.seed + 1, progress=False)
                    seconds.setdefault((view, kind), []).append((time.process_time() - started) / len(examples))
                    rewards[(i, view, kind)] = [r["reward"] for r in rows]
    result = {"runs": [str(r) for r in runs], "prompts": args.prompts, "evaluations": {}}
    for (view, kind), per_prompt in seconds.items():
        a, b = rewards[(0, view, kind)], rewards[(1, view, kind)]
        sd = {"a": statistics.pstdev(a), "b": statistics.pstdev(b), "a - b": statistics.stdev([x - y for x, y in zip(a, b)])}
        result["evaluations"][f"{view}, {kind}"] = {
            "seconds_per_prompt": statistics.mean(per_prompt), "mean_a": statistics.mean(a), "mean_b": statistics.mean(b), "sd": sd,
            "cell_se": {n: max(sd["a"], sd["b"]) / math.sqrt(n) for n in SIZES}, "paired_se": {n: sd["a - b"] / math.sqrt(n) for n in SIZES}}
        e = result["evaluations"][f"{view}, {kind}"]
        print(f"{view}, {kind}: {1000 * e['seconds_per_prompt']:.2f} ms per prompt; reward {e['mean_a']:.3f} vs {e['mean_b']:.3f}; "
              f"per-prompt sd {sd['a']:.3f} / {sd['b']:.3f}, of the paired difference {sd['a - b']:.3f}; se of a cell / of a paired "
              "difference at " + ", ".join(f"{n}: {e['cell_se'][n]:.3f} / {e['paired_se'][n]:.3f}" for n in SIZES))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
