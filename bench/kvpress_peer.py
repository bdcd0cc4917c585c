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
Pair `dense`: no eviction on either side (`eviction=none`; kvpress without a press). Pair `snapkv_w64_outside` (RULER):
the context compressed alone, the question, the template's end and the answer prefix kept outside the compressed span;
kvpress: its pipeline's default (the context prefilled under SnapKVPress, window 64, the rest appended after it); ours:
`ContextOnly(SnapKV(window=64))` (`smd_cli/eviction/context_only.py`). Beside pair `snapkv_w64` (the whole prompt
compressed) it measures what keeping the question out of the compressed span is worth, on the same prompts.
`--side speed` is the kvpress environment's half of `bench/long_prompt_rollout.py --kvpress-python`.
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
    "snapkv_w64_outside": (("snapkv", {"window": 64}), ("SnapKVPress", {"window_size": 64})),
}
OUTSIDE = {"snapkv_w64_outside"}  # the context compressed alone, the question appended after (kvpress's pipeline's default)


def kvpress_side(spec: dict) -> dict:
    """In the kvpress environment: greedy completions and kept prompt entries per press and compression."""
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    out = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5", "rows": [],
           "transformers": transformers.__version__}
    pipe = None
    for pair in spec["pairs"]:
        name, fields = PAIRS[pair][1]
        for c in spec["compressions"]:
            press = getattr(kvpress, name)(compression_ratio=c, **fields) if name else None
            texts, kept = [], []
            t0 = time.perf_counter()
            for ids, closing in zip(spec["prompts"], spec["closing"]):
                if pair in OUTSIDE:  # kvpress's own pipeline: the context prefilled under the press, the rest after it
                    pipe = pipe or transformers.pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
                    cache = transformers.DynamicCache()
                    split = len(ids) - closing
                    with torch.no_grad():
                        texts += pipe._forward({"context_ids": torch.tensor([ids[:split]]), "questions_ids": [torch.tensor([ids[split:]])]},
                                               max_new_tokens=spec["max_new_tokens"], press=press, cache=cache)
                    kept.append((cache.get_seq_length() + closing) / len(ids))
                    continue
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


def kvpress_speed(spec: dict) -> dict:
    """In the kvpress environment: the whole `generate` call and a one-token call (the prefill) of SnapKVPress at each
    compression and of no press, on the given rows, sampling at temperature 1 with eos disabled; KV bytes held at the
    end (the peak: the cache only grows after the prefill). For bench/long_prompt_rollout.py --kvpress-python."""
    import statistics

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.top_k = None
    ids = torch.tensor(spec["prompts"])
    presses = {"kvpress generate (no press)": None,
               **{f"kvpress snapkv {c}": kvpress.SnapKVPress(compression_ratio=c) for c in spec["compressions"]}}

    def run(press, new: int, seed: int) -> tuple[float, int]:
        torch.manual_seed(seed)
        started = time.perf_counter()
        with torch.no_grad(), (press(model) if press else contextlib.nullcontext()):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=0, eos_token_id=None,
                                 pad_token_id=0, do_sample=True, temperature=1.0, top_p=1.0, return_dict_in_generate=True)
        seconds = time.perf_counter() - started
        if out.sequences.shape[1] - ids.shape[1] != new:
            raise RuntimeError(f"kvpress side: generated {out.sequences.shape[1] - ids.shape[1]} tokens a row, expected {new}")
        return seconds, sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)

    whole, first, kv = ({name: [] for name in presses} for _ in range(3))
    for round_ in range(spec["warmup"] + spec["rounds"]):
        for name, press in presses.items():
            f, _ = run(press, 1, round_)
            w, kv_bytes = run(press, spec["new"], round_)
            print(f"  kvpress side, round {round_} {name}: prefill {f:.2f} s, whole {w:.2f} s", flush=True)
            if round_ >= spec["warmup"]:
                first[name].append(f)
                whole[name].append(w)
                kv[name].append(kv_bytes)
    return {"transformers": transformers.__version__, "methods": {
        name: {"whole": whole[name], "prefill": first[name], "whole_seconds": statistics.median(whole[name]),
               "prefill_seconds": statistics.median(first[name]), "kv_bytes_peak": max(kv[name])} for name in presses}}


def our_side(args) -> tuple[dict, dict]:
    """In this environment: the prompts, our completions and kept fractions, and the spec for the kvpress side."""
    import torch
    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.factories import build_policy, build_task
    from smd_cli.evaluation.policy_grid import evaluate_grid
    from smd_cli.eviction.context_only import ContextOnly
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
        grid, outside = {}, set()
        for pair in args.pairs:
            (option, fields), _ = PAIRS[pair]
            for c in args.compressions:
                node = cfg.copy()
                node.compression = c
                policy = build_policy(node, option)
                for key, value in fields.items():
                    setattr(policy, key, value)
                grid[(pair, c)] = policy
                if pair in OUTSIDE:
                    outside.add((pair, c))
        # every pair on the same prompts with one prefill a prompt (smd_cli.evaluation.policy_grid: each row keeps what its
        # policy keeps alone); batches of prompts, since a 1024-token prefill of 50 rows would not fit
        t0 = time.perf_counter()
        out = evaluate_grid(model, tokenizer, task, examples, grid, max_new_tokens=task.max_new_tokens, prompts_per_batch=args.batch,
                            outside=frozenset(outside))
        seconds = time.perf_counter() - t0
        closing = [task.closing_tokens(e, tokenizer) for e in examples] if outside else [0] * len(examples)  # evaluate_grid checked
        lengths = torch.tensor([len(p) for p in prompts])
        rows = []
        for (pair, c), policy in grid.items():
            kept = (ContextOnly(policy, closing) if pair in OUTSIDE else policy).budget(lengths).float()
            rows.append({"pair": pair, "compression": c, "texts": [r["completion"] for r in out[(pair, c)]["rows"]],
                         "kept_prompt_fraction": float((kept / lengths).mean()), "seconds_all_pairs": seconds})
        spec = {"model": path, "prompts": prompts, "closing": closing, "pairs": args.pairs, "compressions": args.compressions,
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
        out.append({**row, **means, "exact": sum(exact) / len(exact), "exact_ids": [i for i, x in enumerate(exact) if x == 1.0],
                    "per_prompt": scores})
    return out


def _mean_se(values: list[float], sign: bool = False) -> str:
    """'mean ± standard error' over prompts."""
    from smd_cli.tasks.base import mean, stderr  # here: the kvpress side runs in an environment without smd

    return f"{mean(values):{'+' if sign else ''}.3f} ± {stderr(values):.3f}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["ours", "kvpress", "speed"], default="ours",
                        help="kvpress, speed: the kvpress environment's side (speed: for bench/long_prompt_rollout.py)")
    parser.add_argument("--spec", type=Path, help="(kvpress side) the prompts and settings written by our side")
    parser.add_argument("--out", type=Path, help="(kvpress side) where to write its completions")
    parser.add_argument("--kvpress-python", default=".venv-kvpress/bin/python")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--task", choices=["passkey", "ruler"], default="passkey")
    parser.add_argument("--family", default="niah_multikey", help="(ruler) the family")
    parser.add_argument("--haystack", default=None, help="(ruler) the haystack; default: the family's first")
    parser.add_argument("--tokens", type=int, default=None, help="passkey: haystack tokens (160: ~227-token prompts); ruler: "
                        "the whole prompt (1024)")
    parser.add_argument("--batch", type=int, default=4, help="our side's prompts per generate call (each once per pair)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=lambda s: s.split(","), default=["snapkv", "snapkv_w16", "snapkv_w64", "knorm", "random", "streaming"])
    parser.add_argument("--compressions", type=lambda s: [float(x) for x in s.split(",")], default=[0.5])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.side != "ours":
        side = kvpress_side if args.side == "kvpress" else kvpress_speed
        args.out.write_text(json.dumps(side(json.loads(args.spec.read_text()))))
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
    print(f"| pair | c | ours: exact | kvpress: exact | ours: {metric} | kvpress: {metric} | ours - kvpress: {metric} (paired) "
          "| ours: kept | kvpress: kept | both exact | same text |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ours_by = {(a["pair"], a["compression"]): a for a in mine}
    for b in peer:
        a = ours_by[(b["pair"], b["compression"])]
        both = len(set(a["exact_ids"]) & set(b["exact_ids"]))
        same = sum(x == y for x, y in zip(a["texts"], b["texts"]))
        diff = [x[metric] - y[metric] for x, y in zip(a["per_prompt"], b["per_prompt"])]
        print(f"| {a['pair']} | {a['compression']} | {a['exact']:.3f} | {b['exact']:.3f} | {_mean_se([s[metric] for s in a['per_prompt']])} | "
              f"{_mean_se([s[metric] for s in b['per_prompt']])} | {_mean_se(diff, sign=True)} | "
              f"{a['kept_prompt_fraction']:.3f} | {b['kept_prompt_fraction']:.3f} | {both} | {same} |")
    if args.json:
        from smd_cli.runtime.integrity import write_file  # here: the kvpress side runs in an environment without smd

        write_file(args.json, json.dumps({"weights": ours["weights"], "kvpress": theirs.get("kvpress"), "transformers_kvpress": theirs["transformers"],
                                         "args": {k: str(v) for k, v in vars(args).items()}, "ours": mine, "kvpress_rows": peer}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
