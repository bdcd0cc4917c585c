"""How many held-out prompts: the evaluation's cost per prompt, and its noise in a cell and in a paired difference.

Usage: python bench/eval_noise.py [--runs RUN_A RUN_B] [--task vote --seed 0 --prompts 1024] [--json out.json]
       python bench/eval_noise.py --scale small --prompts 256        # SmolLM2-135M on passkey (conf/scale/small.yaml)
Two policies trained from the same start (`--runs`: two `smd train` run directories of the same task and seed;
default: SMD and naive sparse, 40 steps each at the tiny scale and the scale's own steps at the small one, trained here
into a temporary directory) are evaluated on `--prompts` held-out prompts the way `smd train` does (the same prompts
and sampling noise for both; sampled and greedy, with a dense cache and under SnapKV at the scale's compression; at a
scale that evaluates at temperature 0 the sampled evaluation is the greedy one and runs once). Printed per
evaluation and metric (the reward, and exact match: the fraction of rewards of 1): seconds per prompt, the
per-prompt standard deviation of each policy's score and of the paired difference a - b, and what they make the
standard error of a cell and of a paired difference at 16 to 1024 prompts. `make reproduce` compares two cells seed
by seed, so the paired one is what adds to the spread between seeds (README, "Reproducing the paper": the cost model).
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
from smd_cli.config.factories import build_policy, build_task
from smd_cli.config.prompts import load_examples
from smd_cli.evaluation.batch import evaluate
from smd_cli.runs.model_loading import compute_dtype, load_model, set_precision
from smd_cli.runtime.integrity import write_file

SIZES = (16, 32, 64, 128, 256, 512, 1024)


def train(scale: list[str], seed: int, algo: str, where: Path) -> Path:
    run = where / algo
    subprocess.run([sys.executable, "-m", "smd_cli.cli", "train", *scale, f"seed={seed}", f"algo={algo}", "eval.num_prompts=0",
                    "progress=false", "checkpoint.every=0", f"hydra.run.dir={run}"], check=True, stdout=subprocess.DEVNULL)
    return run


def load_run(cfg, run: Path):
    """A run's final weights in the precision `smd train` evaluated them in (SmolLM2: attention summed in float64)."""
    model = AutoModelForCausalLM.from_pretrained(run / "final", torch_dtype=compute_dtype(cfg, torch.device("cpu"))).eval()
    set_precision(cfg, model)
    return model


def scores(rows: list[dict]) -> dict[str, list[float]]:
    """Per prompt: the reward and exact match (1 when the reward is 1)."""
    return {"reward": [r["reward"] for r in rows], "exact": [float(r["reward"] >= 1.0) for r in rows]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs=2, type=Path, default=None)
    ap.add_argument("--scale", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--task", default=None, help="default: vote at the tiny scale, the scale's own task at the small one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    register_recipes()
    scale = ([f"task={args.task or 'vote'}", "steps=40"] if args.scale == "tiny" else
             ["scale=small", *([f"task={args.task}"] if args.task else [])])
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or [train(scale, args.seed, algo, Path(tmp)) for algo in ("smd", "naive_sparse")]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*scale, f"seed={args.seed}", "progress=false", "device=cpu"])
            task = build_task(cfg)
            _, tokenizer = load_model(cfg, task, torch.device("cpu"), progress=False)
            policy = build_policy(cfg, "snapkv")
        examples = load_examples(task, task.test_split, args.prompts)
        kinds = (("sampled", cfg.eval.temperature),) * (cfg.eval.temperature > 0) + (("greedy", 0.0),)
        values, seconds = {}, {}
        for i, run in enumerate(runs):
            model = load_run(cfg, run)
            for view, evicting in (("dense cache", False), ("under eviction", True)):
                for kind, temperature in kinds:
                    started = time.process_time()
                    rows, _ = evaluate(model, tokenizer, task, examples, max_new_tokens=cfg.sampling.max_new_tokens,
                                       batch_size=cfg.eval.batch_size, temperature=temperature, policy=policy if evicting else None,
                                       seed=args.seed + 1, progress=False)
                    seconds.setdefault((view, kind), []).append((time.process_time() - started) / len(examples))
                    values[(i, view, kind)] = scores(rows)
    result = {"runs": [str(r) for r in runs], "scale": args.scale, "prompts": len(examples), "evaluations": {}}
    for (view, kind), per_prompt in seconds.items():
        for metric in ("reward", "exact"):
            a, b = values[(0, view, kind)][metric], values[(1, view, kind)][metric]
            sd = {"a": statistics.pstdev(a), "b": statistics.pstdev(b), "a - b": statistics.stdev([x - y for x, y in zip(a, b)])}
            e = result["evaluations"][f"{view}, {kind}, {metric}"] = {
                "seconds_per_prompt": statistics.mean(per_prompt), "mean_a": statistics.mean(a), "mean_b": statistics.mean(b), "sd": sd,
                "cell_se": {n: max(sd["a"], sd["b"]) / math.sqrt(n) for n in SIZES}, "paired_se": {n: sd["a - b"] / math.sqrt(n) for n in SIZES}}
            print(f"{view}, {kind}, {metric}: {1000 * e['seconds_per_prompt']:.2f} ms per prompt; {e['mean_a']:.3f} vs {e['mean_b']:.3f}; "
                  f"per-prompt sd {sd['a']:.3f} / {sd['b']:.3f}, of the paired difference {sd['a - b']:.3f}; se of a cell / of a paired "
                  "difference at " + ", ".join(f"{n}: {e['cell_se'][n]:.3f} / {e['paired_se'][n]:.3f}" for n in SIZES), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
