"""The shadow replay against the sampler, in float32 and in float64: rounding or a mask error?

Usage: python bench/parity_replay.py [--task vote --seed 0 --prompts 16 --group 4 --policies snapkv,h2o,recent,random,knorm
       --quick --shift-mask] [--json out.json]
The model is the task's warm start for `--seed` (the one `smd train` builds and caches; `--quick`: the quick check's
20-step warm start on 48-token prompts). For each eviction policy at c = 0.5 (and `none`, a dense rollout: no mask), a
rollout of `--prompts` x `--group` rows is sampled and its tokens scored by the learner's shadow replay (`smd
rollout`'s parity report), twice: with the model in float32, as training does, and with the same weights in float64
(rollout and replay both, from the same noise). In float32 the difference |log p_replay - log p_sampler| is rounding
(two kernels, two summation orders) plus any error of the mask; in float64 the rounding left is the sampler's cast of
its logits to float32 (about 1e-6 here), so a mask error, which moves a log-prob by far more, cannot hide in it.
`smd reproduce` reads the JSON for its parity claim: the mask is exact if every policy's float64 difference is within
the float32 bound (`bound`, DESIGN.md contract 1); `--shift-mask` replays a wrong mask (every eviction one decode step
late) to show that the check fails then.
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, register_recipes
from smd_cli.rollout import generate, sampling_noise
from smd_cli.stages.common import build_policy, build_task, load_examples, load_model
from smd_cli.stages.rollout import parity_report

BOUND = 1e-5  # DESIGN.md contract 1: |log p_learner - log p_sampler| in float32
QUICK = ["model.warmstart.steps=20", "task.prompt_tokens=48"]  # `smd reproduce quick=true`'s warm start


def replay(model, tokenizer, prompts, policy, max_new_tokens: int, noise: torch.Tensor, shift: bool) -> dict:
    """A rollout under `policy` (None: dense; a fresh copy, so every call starts from the same random state) and its
    shadow replay's difference from the sampler, both in the model's dtype. `shift`: the replay evicts every entry
    one decode step later than the sampler did (a deliberately wrong mask)."""
    batch = generate(model, prompts, policy=copy.deepcopy(policy), max_new_tokens=max_new_tokens, temperature=1.0, noise=noise,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False)
    if shift and batch.evict_at is not None:
        at, T = batch.evict_at, batch.evict_at.shape[-1]  # padding columns hold 0, never-evicted entries T
        batch.evict_at = torch.where((at > 0) & (at < T), at + 1, at)
    report = parity_report(model, batch, 1.0, physical=False, backend="sdpa")
    return {"max_abs_diff": report["parity/max_abs_diff_shadow"], "mean_abs_diff": report["parity/mean_abs_diff_shadow"],
            "dense_mean_abs_diff": report["mismatch/dense_mean_abs_diff"], "tokens": int(batch.response_mask.sum())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="vote")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--compression", type=float, default=0.5)
    ap.add_argument("--policies", default="snapkv,h2o,recent,random,knorm")
    ap.add_argument("--shift-mask", action="store_true", help="replay a wrong mask (evictions one step late): the check must fail")
    ap.add_argument("--quick", action="store_true", help="the quick check's warm start (20 steps, 48-token prompts)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    register_recipes()
    overrides = [f"task={args.task}", f"seed={args.seed}", f"compression={args.compression}", "progress=false", "device=cpu",
                 *(QUICK if args.quick else [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
        task = build_task(cfg)
        model, tokenizer = load_model(cfg, task, torch.device("cpu"), progress=False)
        policies = {name: build_policy(cfg, name) for name in args.policies.split(",")}
    examples = [e for e in load_examples(task, task.test_split, args.prompts) for _ in range(args.group)]
    prompts = [task.encode_prompt(e, tokenizer) for e in examples]
    steps = cfg.sampling.max_new_tokens
    noise = sampling_noise(len(prompts), steps, torch.Generator().manual_seed(args.seed))
    wide = copy.deepcopy(model).double()
    started = time.perf_counter()
    result = {"task": args.task, "seed": args.seed, "compression": args.compression, "rows": len(prompts), "quick": args.quick,
              "shift_mask": args.shift_mask, "bound": BOUND, "policies": {}}
    for name, policy in {"none": None, **policies}.items():
        p = result["policies"][name] = {"float32": replay(model, tokenizer, prompts, policy, steps, noise, args.shift_mask),
                                        "float64": replay(wide, tokenizer, prompts, policy, steps, noise, args.shift_mask)}
        print(f"{name:8s} max |log p_replay - log p_sampler|: float32 {p['float32']['max_abs_diff']:.2g}, "
              f"float64 {p['float64']['max_abs_diff']:.2g} (means {p['float32']['mean_abs_diff']:.2g}, "
              f"{p['float64']['mean_abs_diff']:.2g}; a dense learner: {p['float32']['dense_mean_abs_diff']:.3g})")
    worst = max(p["float64"]["max_abs_diff"] for p in result["policies"].values())
    result["mask_exact"] = worst <= BOUND
    result["seconds"] = time.perf_counter() - started
    print(f"the mask is {'exact' if result['mask_exact'] else 'NOT exact'}: in float64 the replay is within {worst:.2g} of the "
          f"sampler (bound {BOUND:g})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
