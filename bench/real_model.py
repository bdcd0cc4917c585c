"""SmolLM2-135M-Instruct (model=smollm2_135m) on passkey retrieval: what eviction does to a real model, measured.

Usage: python bench/real_model.py PART [--n N] [--json OUT]     (results/real_model_cpu.md holds the numbers)

  dense        greedy passkey accuracy with a dense cache against haystack length (the model's own ceiling)
  compression  greedy accuracy for every eviction policy at c = 0.3, 0.5, 0.7, 0.9 at one length (`--tokens`), with
               the key's retention per layer (the fraction of (key token, KV head) entries kept, per layer)
  digits       why SnapKV loses keys: greedy accuracy and the retention of each digit of the key (first copy, second
               copy; over layers and KV heads) for SnapKV variants (window, pooling kernel) and Recent at c = 0.5
  float64      where parity's last 1e-5 comes from: float64 rollouts per policy at c = 0.5; the shadow replay's logits against
               the physical-eviction learner's (an independent path: re-run the prefill, evict by slicing, teacher-force)
               in float64, and the two float32 log-softmax formulas the sampler and the learner use, on the same logits
  parity       sampled rollouts (T = 1) per policy and compression: the shadow replay's and the physical learner's
               |log p - log p_sampler| (parity), and the dense learner's (the mismatch naive sparse trains on: mean, k3,
               largest); with --float64 the same rollouts in float64 (model and replay), which separates float32
               rounding (gone in float64) from a mask error (which would stay)

The model is loaded once through `load_model` (the dequantised Q4_1 GGUF when the Hub is out of reach: every table
says which weights ran). Prompts: the task's test split, each with its own depth drawn from (seed, index).
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
from smd_cli.evaluation.batch import evaluate, evidence_kept
from smd_cli.rollout.sampler import generate, response_texts
from smd_cli.runs.model_loading import load_model, weights_label
from smd_cli.runtime.integrity import write_file
from smd_cli.stages.rollout import parity_report

POLICIES = ["snapkv", "h2o", "recent", "random", "knorm"]
COMPRESSIONS = [0.3, 0.5, 0.7, 0.9]


def setup(tmp: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["model=smollm2_135m", "task=passkey", "device=cpu", "progress=false", "threads=2",
                                                     f"+run_dir={tmp}", *overrides])
    torch.set_num_threads(cfg.threads)
    task = build_task(cfg)
    model, tokenizer = load_model(cfg, task, torch.device("cpu"))
    return cfg, task, model, tokenizer


def policy(cfg, name: str, compression: float, **fields):
    node = cfg.copy()
    node.compression = compression
    out = build_policy(node, name)
    for key, value in fields.items():
        setattr(out, key, value)
    return out


def accuracy(rows) -> dict:
    return {"exact": sum(r["reward"] == 1.0 for r in rows) / len(rows), "reward": sum(r["reward"] for r in rows) / len(rows), "n": len(rows)}


def part_dense(cfg, task, model, tokenizer, args) -> list[dict]:
    out = []
    for tokens in args.lengths:
        task.prompt_tokens = tokens
        examples = task.examples("test", args.n)
        t0 = time.perf_counter()
        rows, _ = evaluate(model, tokenizer, task, examples, max_new_tokens=task.max_new_tokens, batch_size=args.batch, progress=False)
        out.append({"haystack_tokens": tokens, "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rows) / len(rows),
                    **accuracy(rows), "seconds": time.perf_counter() - t0, "wrong": [r["completion"] for r in rows if r["reward"] < 1][:4]})
        print(json.dumps(out[-1]), flush=True)
    return out


def part_compression(cfg, task, model, tokenizer, args) -> list[dict]:
    task.prompt_tokens = args.tokens
    examples = task.examples("test", args.n)
    out = []
    for name in args.policies:
        for c in args.compressions:
            t0 = time.perf_counter()
            rows, summary = evaluate(model, tokenizer, task, examples, max_new_tokens=task.max_new_tokens, batch_size=args.batch,
                                     policy=policy(cfg, name, c, **_fields(args)), progress=False)
            layers = [summary[f"evidence/kept_l{layer}"] for layer in range(model.config.num_hidden_layers)]
            out.append({"policy": name, "compression": c, **accuracy(rows), "key_kept_mean": summary["evidence/kept"], "key_kept_per_layer": layers,
                        "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rows) / len(rows), "seconds": time.perf_counter() - t0,
                        "completions": [r["completion"] for r in rows]})
            print(json.dumps({k: v for k, v in out[-1].items() if k not in ("key_kept_per_layer", "completions")}), flush=True)
    return out


VARIANTS = {  # name -> (eviction option, fields)
    "snapkv w16 k5 (ours)": ("snapkv", {}),
    "snapkv w16 k1 (no pooling)": ("snapkv", {"kernel": 1}),
    "snapkv w16 k9": ("snapkv", {"kernel": 9}),
    "snapkv w64 k5 (kvpress's window)": ("snapkv", {"window": 64}),
    "snapkv w32 k7": ("snapkv", {"window": 32, "kernel": 7}),
    "recent": ("recent", {}),
}


def part_digits(cfg, task, model, tokenizer, args) -> list[dict]:
    task.prompt_tokens = args.tokens
    examples = task.examples("test", args.n)
    prompts = [task.encode_prompt(e, tokenizer) for e in examples]
    out = []
    for name, (option, fields) in VARIANTS.items():
        c = args.compressions[0]
        batch = generate(model, prompts, policy=policy(cfg, option, c, **fields), max_new_tokens=task.max_new_tokens, temperature=0.0,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False)
        rewards = [task.reward(t, e) for t, e in zip(response_texts(batch, tokenizer), examples)]
        P, width = batch.prompt_length, batch.evict_at.shape[-1]
        per_digit = torch.zeros(2, task.key_digits)  # [copy, digit]
        for row, (e, ids) in enumerate(zip(examples, prompts)):
            columns = [P - len(ids) + q for q in task.evidence_positions(e, ids)]
            kept = (batch.evict_at[row][..., columns] >= width).float().mean(dim=(0, 1))  # [2 * digits], over layers and KV heads
            per_digit += kept.view(2, task.key_digits) / len(examples)
        out.append({"variant": name, "compression": c, "exact": sum(r == 1.0 for r in rewards) / len(rewards), "reward": sum(rewards) / len(rewards),
                    "digit_kept_first_copy": per_digit[0].tolist(), "digit_kept_second_copy": per_digit[1].tolist(),
                    "completions": response_texts(batch, tokenizer)})
        print(json.dumps({k: v for k, v in out[-1].items() if k != "completions"}), flush=True)
    return out


def _fields(args) -> dict:
    return {"window": args.window} if args.window else {}


def part_parity(cfg, task, model, tokenizer, args) -> list[dict]:
    task.prompt_tokens = args.tokens
    examples = [e for e in task.examples("test", args.n) for _ in range(args.group)]
    prompts = [task.encode_prompt(e, tokenizer) for e in examples]
    out = []
    dtypes = [torch.float32] + ([torch.float64] if args.float64 else [])
    for dtype in dtypes:
        scored = model if dtype == torch.float32 else _copy(model, dtype)
        for name in args.policies:
            for c in (args.compressions if dtype == torch.float32 else [0.5]):
                t0 = time.perf_counter()
                batch = generate(scored, prompts, policy=policy(cfg, name, c, **_fields(args)), max_new_tokens=task.max_new_tokens, temperature=1.0,
                                 generator=torch.Generator().manual_seed(args.seed), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False)
                report = parity_report(scored, batch, 1.0, physical=args.physical)
                rewards = [task.reward(t, e) for t, e in zip(response_texts(batch, tokenizer), examples)]
                out.append({"dtype": str(dtype).removeprefix("torch."), "policy": name, "compression": c, **report,
                            "kv/kept_fraction": batch.stats["kv/kept_fraction"], "key_kept": evidence_kept(task, batch, examples, prompts).get("evidence/kept"),
                            "reward": sum(rewards) / len(rewards), "tokens": int(batch.response_mask.sum()), "seconds": time.perf_counter() - t0})
                print(json.dumps(out[-1]), flush=True)
    return out


def part_float64(cfg, task, model, tokenizer, args) -> list[dict]:
    from smd_cli.learner.forward import response_hidden
    from smd_cli.learner.physical import physical_response_logits

    task.prompt_tokens = args.tokens
    examples = [e for e in task.examples("test", args.n) for _ in range(args.group)]
    prompts = [task.encode_prompt(e, tokenizer) for e in examples]
    double = _copy(model, torch.float64)
    out = []
    for name in args.policies:
        batch = generate(double, prompts, policy=policy(cfg, name, 0.5), max_new_tokens=task.max_new_tokens, temperature=1.0,
                         generator=torch.Generator().manual_seed(args.seed), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False)
        mask, tokens = batch.response_mask, batch.input_ids[:, batch.prompt_length:]
        with torch.no_grad():
            replay = double.get_output_embeddings()(response_hidden(double, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                                                    batch.evict_at))[mask]  # [n, V] float64
            physical = physical_response_logits(double, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)[mask]
        picked = tokens[mask][:, None]
        logp64 = torch.log_softmax(replay, -1).gather(-1, picked).squeeze(-1)
        l32 = replay.float()
        sampler_formula = torch.log_softmax(l32, -1).gather(-1, picked).squeeze(-1)  # rollout.sample's
        learner_formula = l32.gather(-1, picked).squeeze(-1) - torch.logsumexp(l32, -1)  # scoring.vocab_terms'
        out.append({"policy": name, "tokens": int(mask.sum()),
                    "logits_replay_vs_physical_max": float((replay - physical).abs().max()),
                    "logp_float64_replay_vs_sampler_max": float((logp64 - batch.logprobs[mask].double()).abs().max()),
                    "float32_formulas_max": float((sampler_formula - learner_formula).abs().max()),
                    "float32_formulas_mean": float((sampler_formula - learner_formula).abs().mean()),
                    "sampler_formula_vs_float64_max": float((sampler_formula.double() - logp64).abs().max())})
        print(json.dumps(out[-1]), flush=True)
    return out


def _copy(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["dense", "compression", "digits", "float64", "parity"])
    parser.add_argument("--n", type=int, default=16, help="prompts")
    parser.add_argument("--group", type=int, default=2, help="parity: samples per prompt")
    parser.add_argument("--tokens", type=int, default=160, help="haystack tokens (compression, parity); 160 gives ~227-token prompts")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    parser.add_argument("--compressions", type=lambda s: [float(x) for x in s.split(",")], default=COMPRESSIONS)
    parser.add_argument("--window", type=int, default=None, help="override every policy's protected recent window")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float64", action="store_true", help="parity: also replay at c = 0.5 in float64")
    parser.add_argument("--physical", action="store_true", help="parity: also the physical-eviction learner")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, task, model, tokenizer = setup(tmp)
        started = time.perf_counter()
        rows = {"dense": part_dense, "compression": part_compression, "digits": part_digits, "float64": part_float64, "parity": part_parity}[args.part](cfg, task, model, tokenizer, args)
    result = {"part": args.part, "weights": weights_label(model), "args": {k: v for k, v in vars(args).items() if k != "json"},
              "torch_threads": torch.get_num_threads(), "seconds": time.perf_counter() - started, "rows": rows}
    print(f"weights: {result['weights']}; {result['seconds']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
