"""Rollouts at long prompts: prefill, decode and the whole call, and the KV bytes held, of our sampler (dense and evicting)
against transformers' `generate`, side by side on the same prompts of the real SmolLM2-135M-Instruct (issue 41 item 1).

Per prompt length, `rows` rows (`group` samples of each prompt: our sampler prefills a repeated prompt once, `generate`
prefills every row), `new` new tokens, eos disabled, sampling at temperature 1, one thread:

- `smd dense`: our sampler without eviction, as `smd train` runs it (SmolLM2's config attends in float64 for exact
  parity, except a prompt's own rows: `smd_cli.attention.kernels`)
- `smd dense, f32 attention`: the same with `model.attention_dtype=null` (what the float64 costs; parity then holds to
  float32 rounding, not bit for bit)
- `smd <policy> c`: our evicting sampler (SnapKV by default; `--policies snapkv,h2o,recent`) at each `--compression`,
  and `smd <policy> c, f32 attention` (float32 attention, as kvpress and `generate` attend)
- `hf dynamic` / `hf static`: `model.generate` with transformers' SDPA attention, same weights
- with `--kvpress-python .venv-kvpress/bin/python`: `kvpress snapkv c` (NVIDIA kvpress 0.5.5's SnapKVPress in
  `generate`, its defaults: window 64, kernel 5, float32 SDPA) at each `--compression`, and `kvpress generate (no press)`,
  in kvpress's own environment (transformers < 5.3) on the same rows, after ours; column `x kvpress snapkv`: ours over
  kvpress's SnapKV at the same compression

Each method is timed twice per round: the whole call (`new` tokens), and a call of one token (the prefill and the first
sample); decode = (whole - prefill) / (new - 1) per step. Rounds are interleaved (one call of each method per round,
after `--warmup` rounds); medians are reported. KV bytes: ours measured (the cache's peak storage, `kv/bytes_peak`);
`generate`'s dense cache computed (rows x layers x 2 x KV heads x (P + new - 1) x head dim x 4 bytes), which is what our
dense cache holds too.

    python bench/long_prompt_rollout.py --prompts 1024,2048 --rows 8 --group 4 --new 64 --out results/bench/long_prompt_rollout.json

Not in `make bench` (about 40 minutes on two cores at 1024 and 2048).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import _prompts, load_named  # noqa: E402

from smd_cli.eviction.h2o import H2O  # noqa: E402
from smd_cli.eviction.recent import Recent  # noqa: E402
from smd_cli.eviction.snapkv import SnapKV  # noqa: E402
from smd_cli.model.build import set_attention_dtype  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"snapkv": lambda c: SnapKV(c, sink=4, window=16), "h2o": lambda c: H2O(c, window=16), "recent": lambda c: Recent(c, sink=4)}


def _check_tokens(got: int, expected: int) -> None:
    if got != expected:
        raise RuntimeError(f"generated {got} tokens, expected {expected}: eos must be disabled")


def methods(model, prompts: list[list[int]], policies: list[str], compressions: list[float]) -> dict:
    """name -> run(new tokens, seed) -> KV bytes held at the peak."""
    f32 = copy.deepcopy(model)
    set_attention_dtype(f32, None)
    hf = copy.deepcopy(model)
    hf.config._attn_implementation = "sdpa"
    hf.generation_config.top_k = None
    ids = torch.tensor(prompts)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def ours(m, make=None):
        def run(new, seed):
            batch = generate(m, prompts, policy=None if make is None else make(), max_new_tokens=new, temperature=1.0,
                             generator=torch.Generator().manual_seed(seed), eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
            _check_tokens(int(batch.response_mask.sum()), len(prompts) * new)
            return batch.stats["kv/bytes_peak"]
        return run

    def theirs(**cache):
        def run(new, seed):
            torch.manual_seed(seed)
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, do_sample=True, temperature=1.0, top_p=1.0, **cache)
            _check_tokens(ids.shape[0] * (out.shape[1] - ids.shape[1]), ids.shape[0] * new)
            return ids.shape[0] * config.num_hidden_layers * 2 * config.num_key_value_heads * (ids.shape[1] + new - 1) * head_dim * 4
        return run

    table = {"smd dense": ours(model), "smd dense, f32 attention": ours(f32)}
    for name in policies:
        for c in compressions:
            table[f"smd {name} {c}"] = ours(model, lambda name=name, c=c: POLICIES[name](c))
            table[f"smd {name} {c}, f32 attention"] = ours(f32, lambda name=name, c=c: POLICIES[name](c))
    return {**table, "hf dynamic": theirs(), "hf static": theirs(cache_implementation="static")}


def kvpress_side(python: str, model, prompts: list[list[int]], new: int, rounds: int, warmup: int, compressions) -> dict:
    """kvpress's SnapKVPress (and its environment's plain `generate`) on the same rows, timed by bench/kvpress_peer.py
    --side speed in the kvpress environment (kvpress 0.5.5 pins transformers < 5.3)."""
    spec = {"model": model.config._name_or_path, "prompts": prompts, "new": new, "rounds": rounds, "warmup": warmup,
            "compressions": compressions, "threads": torch.get_num_threads()}
    if not Path(spec["model"]).is_dir():
        raise SystemExit(f"--kvpress-python needs the model as a local directory; {spec['model']!r} is not one")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([python, str(Path(__file__).parent / "kvpress_peer.py"), "--side", "speed", "--spec", str(spec_path),
                        "--out", str(out_path)], check=True)
        return json.loads(out_path.read_text())


def measure(model, prompt: int, rows: int, group: int, new: int, rounds: int, warmup: int, policies, compressions,
            only: list[str] | None = None, kvpress_python: str | None = None) -> dict:
    prompts = [p for p in _prompts(rows // group, prompt, 40_000) for _ in range(group)]
    runs = methods(model, prompts, policies, compressions)
    if only:  # the ratios' references are always measured
        runs = {name: run for name, run in runs.items() if name in ("smd dense", "hf static") or any(o in name for o in only)}
    whole, first, kv = ({name: [] for name in runs} for _ in range(3))
    for round_ in range(warmup + rounds):
        for name, run in runs.items():
            times = []
            for n in (1, new):
                started = time.perf_counter()
                kv_bytes = run(n, round_)
                times.append(time.perf_counter() - started)
            if round_ >= warmup:
                first[name].append(times[0])
                whole[name].append(times[1])
                kv[name].append(kv_bytes)
            print(f"  P={prompt} round {round_} {name}: prefill {times[0]:.2f} s, whole {times[1]:.2f} s", flush=True)
    out = {}
    for name in runs:
        w, f = statistics.median(whole[name]), statistics.median(first[name])
        out[name] = {"whole_seconds": w, "prefill_seconds": f, "decode_ms_per_step": 1000 * (w - f) / (new - 1),
                     "tokens_per_second": rows * new / w, "kv_bytes_peak": max(kv[name]), "whole": whole[name], "prefill": first[name]}
    if kvpress_python:
        theirs = kvpress_side(kvpress_python, model, prompts, new, rounds, warmup, compressions)
        for name, r in theirs["methods"].items():
            out[name] = {**r, "decode_ms_per_step": 1000 * (r["whole_seconds"] - r["prefill_seconds"]) / (new - 1),
                         "tokens_per_second": rows * new / r["whole_seconds"], "transformers": theirs["transformers"]}
    for row in out.values():
        row["x_hf_static"] = row["tokens_per_second"] / out["hf static"]["tokens_per_second"]
        row["x_smd_dense"] = row["tokens_per_second"] / out["smd dense"]["tokens_per_second"]
        row["kv_over_smd_dense"] = row["kv_bytes_peak"] / out["smd dense"]["kv_bytes_peak"]
    for name, row in out.items():  # ours over kvpress's SnapKV at the same compression, when both ran
        peer = out.get(f"kvpress snapkv {name.split()[2].rstrip(',')}") if name.startswith("smd snapkv") else None
        if peer:
            row["x_kvpress_snapkv"] = row["tokens_per_second"] / peer["tokens_per_second"]
    return out


def format_table(prompt: int, table: dict) -> str:
    lines = [f"P = {prompt}",
             f"{'method':<34} {'prefill s':>9} {'decode ms/step':>14} {'whole s':>8} {'tokens/s':>8} {'x hf static':>11} "
             f"{'x smd dense':>11} {'KV MB':>8} {'KV x dense':>10} {'x kvpress snapkv':>16}"]
    for name, r in table.items():
        peer = f"{r['x_kvpress_snapkv']:>16.2f}" if "x_kvpress_snapkv" in r else f"{'':>16}"
        lines.append(f"{name:<34} {r['prefill_seconds']:>9.2f} {r['decode_ms_per_step']:>14.1f} {r['whole_seconds']:>8.2f} "
                     f"{r['tokens_per_second']:>8.2f} {r['x_hf_static']:>11.2f} {r['x_smd_dense']:>11.2f} "
                     f"{r['kv_bytes_peak'] / 2**20:>8.1f} {r['kv_over_smd_dense']:>10.2f} {peer}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="a model config of conf/model/")
    parser.add_argument("--prompts", default="1024,2048", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="rows per prompt (GRPO's G samples)")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--policies", default="snapkv")
    parser.add_argument("--compression", default="0.5,0.75")
    parser.add_argument("--only", default="", help="comma-separated parts of method names to run (besides the references "
                        "`smd dense` and `hf static`), e.g. 'h2o'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kvpress-python", default=None, help="also time kvpress's SnapKVPress at each --compression (and its "
                        "environment's plain generate) on the same rows, in that environment (make .venv-kvpress/.installed)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "long_prompt_rollout.json")
    args = parser.parse_args()
    if args.rows % args.group or args.new < 2:
        raise SystemExit(f"--rows ({args.rows}) must be a multiple of --group ({args.group}) and --new at least 2")
    torch.set_num_threads(args.threads)
    model, _, weights = load_named(args.model)
    report = {"command": " ".join(["python", "bench/long_prompt_rollout.py", *sys.argv[1:]]), "weights": weights, "threads": args.threads,
              "torch": torch.__version__, "rows": args.rows, "group": args.group, "new_tokens": args.new, "rounds": args.rounds,
              "attention_dtype": getattr(model.config, "smd_attention_dtype", None), "lengths": {}}
    for prompt in (int(p) for p in args.prompts.split(",")):
        table = measure(model, prompt, args.rows, args.group, args.new, args.rounds, args.warmup, args.policies.split(","),
                        [float(c) for c in args.compression.split(",")], [o for o in args.only.split(",") if o], args.kvpress_python)
        report["lengths"][str(prompt)] = table
        print(format_table(prompt, table), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.out, json.dumps(report, indent=2) + "\n")  # after each length: a long run keeps what it measured
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
