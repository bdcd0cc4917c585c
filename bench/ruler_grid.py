"""RULER families under eviction policies, greedy, each prompt prefilled once for all policies
(`smd_cli.evaluation.policy_grid`): the calibration of issue 42 and the RULER table.

Usage: python bench/ruler_grid.py --family niah_multikey[:HAYSTACK] ... [--tokens 1024] [--policies dense,snapkv,...]
                                  [--compression 0.5] [--n 50] [--json OUT] [OVERRIDE ...]

A policy named `NAME:outside` (e.g. `snapkv:outside`) compresses the context alone, the question, the template's end
and the answer prefix kept outside the compressed span (`smd_cli.eviction.context_only`: kvpress's default setting);
plain `NAME` compresses the whole prompt, question included, as the rollouts do (kvpress's `query_aware`).

Each (family, length) is one cell of the grid: the task's test examples 0..n-1, every policy x compression on them.
A cell already in `--json` (same family, haystack, length, n, policies and compressions) is kept, not re-run, so an
interrupted run resumes. The model is loaded once through `load_model` (`model=smollm2_135m`: the dequantised Q4_1
GGUF offline). OVERRIDE: extra `smd eval` overrides, e.g. model.attention_dtype=null.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR
from smd_cli.config.factories import build_policy, build_task
from smd_cli.evaluation.policy_grid import evaluate_grid
from smd_cli.runs.model_loading import load_model, weights_label


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", action="append", required=True, help="FAMILY or FAMILY:HAYSTACK (repeatable)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024])
    parser.add_argument("--policies", default="dense,snapkv,recent,h2o")
    parser.add_argument("--compression", type=float, nargs="+", default=[0.5])
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4, help="prompts per generate call (each repeated once per policy)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args, overrides = parser.parse_known_args(argv)
    done = json.loads(args.json.read_text()) if args.json and args.json.is_file() else []
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory(prefix="ruler_grid_") as tmp:  # the composed config's run_dir, removed at the end
        return run_cells(args, overrides, done, policies, tmp)


def run_cells(args, overrides: list[str], done: list[dict], policies: list[str], tmp: str) -> int:
    for spec in args.family:
        family, _, haystack = spec.partition(":")
        for tokens in args.tokens:
            key = {"family": family, "haystack": haystack or None, "prompt_tokens": tokens, "n": args.n, "policies": policies,
                   "compressions": args.compression}
            if any(all(cell.get(k) == v for k, v in key.items()) for cell in done):
                print(f"kept: {key}", flush=True)
                continue
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="eval", overrides=[
                    "model=smollm2_135m", "task=ruler", f"task.family={family}", f"task.haystack={haystack or 'null'}",
                    f"task.prompt_tokens={tokens}", "device=cpu", "progress=false", f"threads={args.threads}", f"+run_dir={tmp}",
                    *overrides])
            torch.set_num_threads(cfg.threads)
            task = build_task(cfg)
            model, tokenizer = load_model(cfg, task, torch.device("cpu"), progress=False)
            grid, outside = {}, set()
            for name in policies:
                for c in ([None] if name == "dense" else args.compression):
                    node = cfg.copy()
                    if c is not None:
                        node.compression = c
                    label = name if c is None else f"{name}@{c}"
                    grid[label] = None if name == "dense" else build_policy(node, name.removesuffix(":outside"))
                    if name.endswith(":outside"):
                        outside.add(label)
            examples = task.examples("test", args.n)
            started = time.perf_counter()
            out = evaluate_grid(model, tokenizer, task, examples, grid, max_new_tokens=task.max_new_tokens,
                                prompts_per_batch=args.batch, outside=frozenset(outside))
            cell = {**key, "haystack": task.haystack, "weights": weights_label(model), "max_new_tokens": task.max_new_tokens,
                    "seconds": time.perf_counter() - started, "threads": cfg.threads, "overrides": overrides,
                    "results": {name: {"summary": r["summary"], "completions": [x["completion"] for x in r["rows"]],
                                       "scores": [x["ruler"] for x in r["rows"]]} for name, r in out.items()}}
            cell["haystack"] = haystack or None
            done.append(cell)
            line = " ".join(f"{name}={r['summary']['ruler']:.3f}" for name, r in out.items())
            print(f"{family}:{task.haystack} {tokens} n={args.n} {cell['seconds']:.0f}s  {line}", flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(done, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
