"""bf16 on the CPU, side by side with float32 on the same real model, prompts and seeds (issue 41 item 3): SMD's
parity at every training step and every eviction policy (`none`: the evicting cache keeping everything), the dense learner's mismatch beside it (what SMD removes),
and the step time of each dtype.

For each policy (and `none`, a dense rollout), each dtype gets its own copy of the model and optimizer (bf16: float32
masters, as `smd train` builds it, `smd_cli.model.precision.build_optimizer`) and runs `--steps` GRPO steps of
`algo=smd`: a rollout of `--prompts` x `--group` rows under the policy, then `learner_step`, whose first pass reads
the replay's max |log p_learner - log p_sampler| (`mismatch/max_abs_diff`) and the dense teacher's
(`mismatch/dense_max_abs_diff`) at the weights the rollout was drawn with. The two dtypes alternate step by step
(load drift hits both alike); the rollout and the learner are timed apart, and the ratios are of medians.

    .venv/bin/python bench/bf16_cpu.py                                   # SmolLM2, passkey at 512 tokens, every policy
    .venv/bin/python bench/bf16_cpu.py --prompt-tokens 1024 --policies snapkv --steps 3
    .venv/bin/python bench/bf16_cpu.py --json results/bench/bf16_cpu.json

bf16 needs a CPU with native bf16 (AVX512-BF16 or AMX); elsewhere it runs, emulated and slow, and says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.learner.losses import group_advantages  # noqa: E402
from smd_cli.learner.step import Algorithm, learner_step  # noqa: E402
from smd_cli.model.precision import build_optimizer  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402

POLICIES = ("none", "snapkv", "h2o", "recent", "random", "knorm")
DTYPES = ("float32", "bfloat16")


def native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def setup(model_name: str, dtype: str, prompt_tokens: int, prompts: int, compression: float):
    """(model, tokenizer, prompt ids, {policy name: policy}) as `smd rollout` builds them from its config."""
    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.factories import build_policy, build_task
    from smd_cli.config.prompts import encode_prompt, load_examples
    from smd_cli.runs.model_loading import load_model

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="rollout", overrides=[f"model={model_name}", f"model.cpu_dtype={dtype}", "task=passkey",
                                                        f"task.prompt_tokens={prompt_tokens}", "device=cpu", "progress=false",
                                                        "threads=null", f"compression={compression}", f"+run_dir={tmp}"])
        task = build_task(cfg)
        model, tokenizer = load_model(cfg, task, torch.device("cpu"), progress=False)
        ids = [encode_prompt(task, e, tokenizer) for e in load_examples(task, "train", prompts)]
        policies = {name: build_policy(cfg, name) for name in POLICIES}  # none: KeepAll, the evicting cache keeping all
    return model.eval(), tokenizer, ids, policies


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="passkey prompt length in the model's tokens")
    ap.add_argument("--prompts", type=int, default=2, help="distinct prompts a step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's G)")
    ap.add_argument("--response", type=int, default=16, help="new tokens per row")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps per policy and dtype (the first one also warms up)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {','.join(POLICIES)}")
    ap.add_argument("--compression", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    names = args.policies.split(",")
    if not set(names) <= set(POLICIES):
        ap.error(f"--policies: from {', '.join(POLICIES)}")
    torch.set_num_threads(args.threads)
    built = {d: setup(args.model, d, args.prompt_tokens, args.prompts, args.compression) for d in DTYPES}
    tokenizer = built["float32"][1]
    prompts = [p for p in built["float32"][2] for _ in range(args.group)]
    assert prompts == [p for p in built["bfloat16"][2] for _ in range(args.group)]
    rows = []
    for name in names:
        states = {}
        for d in DTYPES:
            model = copy.deepcopy(built[d][0])
            states[d] = (model, build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=args.lr)))
        for step in range(1, args.steps + 1):
            advantages = group_advantages(torch.randn(len(prompts), generator=torch.Generator().manual_seed(step)), args.group)
            for d in DTYPES:
                model, optimizer = states[d]
                t0 = time.perf_counter()
                batch = generate(model, prompts, policy=built[d][3][name], max_new_tokens=args.response, temperature=1.0,
                                 generator=torch.Generator().manual_seed(step), eos_token_id=-1, pad_token_id=tokenizer.pad_token_id,
                                 measure_dense_kv=False)
                t1 = time.perf_counter()
                metrics = learner_step(model, optimizer, batch, advantages, Algorithm("smd"))
                t2 = time.perf_counter()
                rows.append({"policy": name, "dtype": d, "step": step, "parity": metrics["mismatch/max_abs_diff"],
                             "dense_mismatch": metrics.get("mismatch/dense_max_abs_diff"), "rollout_s": t1 - t0, "learner_s": t2 - t1,
                             "kept": batch.stats["kv/kept_fraction"]})
                print(f"{name:7s} {d:9s} step {step}: parity {rows[-1]['parity']:.3g}, dense learner {rows[-1]['dense_mismatch']:.3g}, "
                      f"rollout {t1 - t0:.1f} s, learner {t2 - t1:.1f} s", flush=True)
    timed = [r for r in rows if r["step"] > 1] or rows  # step 1 warms up
    med = {d: {k: statistics.median(r[k] for r in timed if r["dtype"] == d) for k in ("rollout_s", "learner_s")} for d in DTYPES}
    speedup = {k: med["float32"][k] / med["bfloat16"][k] for k in ("rollout_s", "learner_s")}
    speedup["step"] = sum(med["float32"].values()) / sum(med["bfloat16"].values())
    worst = {d: {n: max(r["parity"] for r in rows if r["dtype"] == d and r["policy"] == n) for n in names} for d in DTYPES}
    dense = {d: {n: max(r["dense_mismatch"] for r in rows if r["dtype"] == d and r["policy"] == n) for n in names} for d in DTYPES}
    print(f"\n{args.model}, passkey {args.prompt_tokens} tokens, {args.prompts} x {args.group} rows, {args.response} new, "
          f"{args.steps} steps, {args.threads} thread(s); native bf16: {native_bf16()}")
    print(f"{'policy':8s} {'SMD fp32':>10s} {'SMD bf16':>10s} {'dense fp32':>11s} {'dense bf16':>11s}")
    for n in names:
        print(f"{n:8s} {worst['float32'][n]:10.3g} {worst['bfloat16'][n]:10.3g} {dense['float32'][n]:11.3g} {dense['bfloat16'][n]:11.3g}")
    print(f"float32 / bfloat16 (medians, steps 2+): rollout {speedup['rollout_s']:.2f}x, learner {speedup['learner_s']:.2f}x, "
          f"step {speedup['step']:.2f}x")
    result = {"args": vars(args) | {"json": None}, "native_bf16": native_bf16(), "rows": rows, "smd_parity_max": worst,
              "dense_mismatch_max": dense, "median_seconds": med, "float32_over_bfloat16": speedup}
    if args.json:
        write_file(args.json, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
