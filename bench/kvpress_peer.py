"""NVIDIA kvpress's eviction beside ours: the same model, the same prompts (token ids), the same compression.

Usage: make bench-kvpress [ARGS="--n 16 --compressions 0.5"]
   or: python bench/kvpress_peer.py --kvpress-python .venv-kvpress/bin/python [--n 16] [--json OUT]
       python bench/kvpress_peer.py --task ruler --family niah_multikey --haystack essay --n 50 --pairs dense,snapkv,streaming,knorm

kvpress 0.5.5 pins transformers < 5.3, so it runs in its own environment (`make bench-kvpress` builds
`.venv-kvpress` with the same CPU torch as a constraint). This script runs our side in this environment (the smd
rollout's `generate`, greedy, 12 new tokens, one policy at a time over the whole batch) and then itself in the
kvpress environment (`--side kvpress`: no smd import), where each press compresses the prefill of one prompt at a
time (`with press(model): model.generate(...)`, greedy). Both read the same dequantised SmolLM2 directory and the
same prompt token ids (chat template, preamble, haystack, question: the whole prompt is compressed, question
included, as our rollout does). Pairs: SnapKV (ours: window 16, 4 sinks kept; kvpress: window 64, no sinks, the
window always kept), KNorm, random, StreamingLLM (kvpress `StreamingLLMPress`, 4 sinks) ~ our `recent`.
Printed: exact-key accuracy, mean reward (digits in place) and the kept fraction of prompt KV entries per pair.
`--task ruler` takes RULER's prompts instead (`task=ruler task.family=F task.haystack=H task.prompt_tokens=T`, 48 new
tokens) and scores RULER's string_match_all (`ruler`) beside the graded reward; our side then sums the attention in
float32 (`model.attention_dtype=null model.logits_dtype=null`, as results/ruler_calibration.md), kvpress's SDPA does too.
Pair `dense`: no eviction on either side (`eviction=none`; kvpress without a press).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIRS = {  # ours (eviction option, fields) -> kvpress (press class, fields; None: no press)
    "dense": (("none", {}), (None, {})),
    "snapkv": (("snapkv", {}), ("SnapKVPress", {})),
    "snapkv_w16": (("snapkv", {}), ("SnapKVPress", {"window_size": 16})),
    "snapkv_w64": (("snapkv", {"window": 64}), ("SnapKVPress", {"window_size": 64})),
    "knorm": (("knorm", {}), ("KnormPress", {})),
    "random": (("random", {}), ("RandomPress", {"seed": 0})),
    "streaming": (("recent", {}), ("StreamingLLMPress", {"n_sink": 4})),
}


def kvpress_side(spec: dict) -> dict:
    """In the kvpress environment: greedy completions and kept prompt entries per press and compression."""
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    out = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5", "rows": []}
    import transformers

    out["transformers"] = transformers.__version__
    for pair in spec["pairs"]:
        name, fields = PAIRS[pair][1]
        for c in spec["compressions"]:
            press = getattr(kvpress, name)(compression_ratio=c, **fields) if name else None
            texts, kept = [], []
            t0 = time.perf_counter()
            for ids in spec["prompts"]:
                input_ids = torch.tensor([ids])
                with torch.no_grad(), (press(model) if press else contextlib.nullcontext()):
                    gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=spec["max_new_tokens"],
                                         do_sample=False, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
                new = gen.sequences[0, len(ids):]
                cache_len = gen.past_key_values.layers[0].keys.shape[2]
                kept.append((cache_len - (len(new) - 1)) / len(ids))  # the last generated token is never fed
                texts.append(tokenizer.decode(new, skip_special_tokens=True))
            out["rows"].append({"pair": pair, "compression": c, "texts": texts, "kept_prompt_fraction": sum(kept) / len(kept),
                                "seconds": time.perf_counter() - t0})
            print(json.dumps({k: v for k, v in out["rows"][-1].items() if k != "texts"}), flush=True)
    return out


def our_side(args) -> tuple[dict, dict]:
    """In this environment: the prompts, our completions and kept fractions, and the spec for the kvpress side."""
    import torch
    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.factories import build_policy, build_task
    from smd_cli.rollout.sampler import generate, response_texts
    from smd_cli.runs.model_loading import load_model, model_source, weights_label

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["model=smollm2_135m", "device=cpu", "progress=false", f"threads={args.threads}",
                                                     *task_overrides(args), f"+run_dir={tmp}"])
        torch.set_num_threads(cfg.threads)
        task = build_task(cfg)
        model, tokenizer = load_model(cfg, task, torch.device("cpu"))
        path = model_source(cfg)[0]
        examples = task.examples("test", args.n)
        prompts = [task.encode_prompt(e, tokenizer) for e in examples]
        rows = []
        for pair in args.pairs:
            (option, fields), _ = PAIRS[pair]
            for c in args.compressions:
                node = cfg.copy()
                node.compression = c
                policy = build_policy(node, option)
                for key, value in fields.items():
                    setattr(policy, key, value)
                t0, texts = time.perf_counter(), []
                for i in range(0, len(prompts), args.batch):  # batches: a 1024-token prefill of 50 rows would not fit
                    batch = generate(model, prompts[i:i + args.batch], policy=policy, max_new_tokens=task.max_new_tokens,
                                     temperature=0.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                     measure_dense_kv=False)
                    texts += response_texts(batch, tokenizer)
                kept = policy.budget(torch.tensor([len(p) for p in prompts])).float() / torch.tensor([len(p) for p in prompts])
                rows.append({"pair": pair, "compression": c, "texts": texts,
                             "kept_prompt_fraction": float(kept.mean()), "seconds": time.perf_counter() - t0})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "texts"}), flush=True)
        spec = {"model": path, "prompts": prompts, "pairs": args.pairs, "compressions": args.compressions,
                "max_new_tokens": task.max_new_tokens, "threads": cfg.threads}
        return {"weights": weights_label(model), "rows": rows, "examples": examples, "task": task}, spec


def task_overrides(args) -> list[str]:
    """The eval config's task (and, for RULER, float32 attention as the calibration scored it)."""
    if args.task == "passkey":
        return ["task=passkey", f"task.prompt_tokens={args.tokens or 160}"]
    return ["task=ruler", f"task.family={args.family}", f"task.prompt_tokens={args.tokens or 1024}",
            *([f"task.haystack={args.haystack}"] if args.haystack else []), "model.attention_dtype=null", "model.logits_dtype=null"]


def score(task_rows: list[dict], examples: list[dict], task) -> list[dict]:
    """Each row's `exact` (passkey: the key; RULER: every answer, no distractor), `reward` and, for RULER, `ruler`
    (string_match_all), means over the prompts; `exact_ids`: the prompts answered exactly."""
    out = []
    for row in task_rows:
        scores = [task.score(text, e) if hasattr(task, "score") else {"reward": task.reward(text, e)}
                  for text, e in zip(row["texts"], examples)]
        exact = [s.get("exact", float(s["reward"] == 1.0)) for s in scores]
        means = {k: sum(s[k] for s in scores) / len(scores) for k in scores[0]}
        out.append({**row, **means, "exact": sum(exact) / len(exact), "exact_ids": [i for i, x in enumerate(exact) if x == 1.0]})
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["ours", "kvpress"], default="ours")
    parser.add_argument("--spec", type=Path, help="(kvpress side) the prompts and settings written by our side")
    parser.add_argument("--out", type=Path, help="(kvpress side) where to write its completions")
    parser.add_argument("--kvpress-python", default=".venv-kvpress/bin/python")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--task", choices=["passkey", "ruler"], default="passkey")
    parser.add_argument("--family", default="niah_multikey", help="(ruler) the family")
    parser.add_argument("--haystack", default=None, help="(ruler) the haystack; default: the family's first")
    parser.add_argument("--tokens", type=int, default=None, help="passkey: haystack tokens (160: ~227-token prompts); ruler: "
                        "the whole prompt (1024)")
    parser.add_argument("--batch", type=int, default=8, help="our side's prompts per generate call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=lambda s: s.split(","), default=["snapkv", "snapkv_w16", "snapkv_w64", "knorm", "random", "streaming"])
    parser.add_argument("--compressions", type=lambda s: [float(x) for x in s.split(",")], default=[0.5])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.side == "kvpress":
        args.out.write_text(json.dumps(kvpress_side(json.loads(args.spec.read_text()))))
        return
    ours, spec = our_side(args)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "kvpress.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([args.kvpress_python, __file__, "--side", "kvpress", "--spec", str(spec_path), "--out", str(out_path)], check=True)
        theirs = json.loads(out_path.read_text())
    mine, peer = score(ours["rows"], ours["examples"], ours["task"]), score(theirs["rows"], ours["examples"], ours["task"])
    what = (f"haystack {args.tokens or 160} tokens" if args.task == "passkey" else
            f"RULER {args.family}{' (' + args.haystack + ')' if args.haystack else ''} at {args.tokens or 1024} tokens")
    print(f"\nweights: {ours['weights']}; kvpress {theirs['kvpress']} on transformers {theirs['transformers']}; {args.n} prompts, "
          f"{what}, greedy")
    metric = "ruler" if args.task == "ruler" else "reward"
    print(f"| pair | c | ours: exact | kvpress: exact | ours: {metric} | kvpress: {metric} | ours: kept | kvpress: kept | both exact | same text |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for a, b in zip(mine, peer):
        both = len(set(a["exact_ids"]) & set(b["exact_ids"]))
        same = sum(x == y for x, y in zip(a["texts"], b["texts"]))
        print(f"| {a['pair']} | {a['compression']} | {a['exact']:.3f} | {b['exact']:.3f} | {a[metric]:.3f} | {b[metric]:.3f} | "
              f"{a['kept_prompt_fraction']:.3f} | {b['kept_prompt_fraction']:.3f} | {both} | {same} |")
    if args.json:
        from smd_cli.runtime.integrity import write_file  # here: the kvpress side runs in an environment without smd

        write_file(args.json, json.dumps({"weights": ours["weights"], "kvpress": theirs.get("kvpress"), "transformers_kvpress": theirs["transformers"],
                                         "args": {k: str(v) for k, v in vars(args).items()}, "ours": mine, "kvpress_rows": peer}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
