"""Decode speed: tokens per second of our rollouts against transformers' own `generate`, same model and shapes.

Four ways to decode the same batch (`rows` prompts of `prompt` tokens, `new` new tokens each, eos disabled
so that every row decodes every token; sampling at temperature 1 by default, `--greedy` for argmax):

- `smd dense`:   `smd_cli.rollout.sampler.generate` without a policy (DynamicCache, the smd attention)
- `smd snapkv`:  `smd_cli.rollout.sampler.generate` with SnapKV(c=0.5): the evicting cache, shadow mask recorded
- `hf dynamic`:  `model.generate` with a DynamicCache
- `hf static`:   `model.generate` with `cache_implementation="static"` (the reference: ratios are to it)
- on CUDA also `smd snapkv eager`: the same as `smd snapkv` with `compile=False` (no CUDA graphs), and
  `graph_check`: the CUDA-graph rollouts against eager ones, token for token (what bench/gpu_check.py runs)

transformers' generate runs on a copy of the model with `attn_implementation="sdpa"` (same weights): the
smd attention's mask function hands the 2-D padding mask through, which a static cache (keys padded to
the cache length) cannot use. Repetitions are interleaved (one of each method per round, after a warm-up
round); the table reports medians, and the best round beside them (on a shared machine interference only
adds time). Tokens per second = rows x new tokens / wall seconds of the whole call (prefill included). On
CUDA every timed call is bracketed by `torch.cuda.synchronize`.

    python bench/decode_speed.py                      # CPU: 4 layers x 128 wide, 16 rows, P = 256, 64 new, 1 thread
    python bench/decode_speed.py --group 8 --out results/bench/decode_speed_grpo.json   # 2 prompts x 8 samples (GRPO's shape)
    python bench/decode_speed.py --device cuda        # CUDA: Qwen3-4B widths with 4 layers, bf16, 64 rows, P = 512, 128 new

Writes results/bench/decode_speed.json (or `--out`). `measure(...)` is what bench/gpu_check.py calls.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.eviction.snapkv import SnapKV  # noqa: E402
from smd_cli.model.build import build_tiny_model  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
CPU_SHAPE = dict(num_hidden_layers=4, hidden_size=128, intermediate_size=384, head_dim=32)
CUDA_SHAPE = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, rope_theta=5e6)
REFERENCE = "hf static"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(rows: int, width: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, width), generator=generator).tolist()


def _methods(model, hf_model, prompts, new: int, greedy: bool, device: torch.device, compile: str | bool) -> dict:
    """name -> a function that decodes the batch once (and returns how many tokens it generated)."""
    rows = len(prompts)
    temperature = 0.0 if greedy else 1.0
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    hf = dict(max_new_tokens=new, min_new_tokens=0, eos_token_id=None, pad_token_id=0, **sampling)
    snapkv = SnapKV(compression=0.5, sink=4, window=16)

    def ours(policy, compile=compile):
        def run(seed):
            batch = generate(model, prompts, policy=policy, max_new_tokens=new, temperature=temperature,
                             generator=torch.Generator(device=device).manual_seed(seed), eos_token_id=-1, pad_token_id=0,
                             measure_dense_kv=False, compile=compile)
            return int(batch.response_mask.sum())
        return run

    def theirs(**cache):
        def run(seed):
            torch.manual_seed(seed)
            out = hf_model.generate(input_ids=ids, attention_mask=mask, **hf, **cache)
            return rows * (out.shape[1] - ids.shape[1])
        return run

    methods = {"smd dense": ours(None), "smd snapkv": ours(snapkv)}
    if device.type == "cuda" and compile is not False:
        methods["smd snapkv eager"] = ours(snapkv, compile=False)
    return {**methods, "hf dynamic": theirs(), "hf static": theirs(cache_implementation="static")}


def measure(device="cpu", shape: dict | None = None, dtype=torch.float32, rows: int = 16, prompt: int = 256, new: int = 64,
            repeats: int = 5, greedy: bool = False, compile: str | bool = "auto", seed: int = 0, group: int = 1, model_name: str | None = None) -> dict:
    """Median tokens per second of each method over `repeats` interleaved rounds (after one warm-up round);
    `group` > 1: the rows are `group` samples of each prompt, as GRPO's rollout (and TRL's) gives them. `model_name`
    (e.g. smollm2_135m): a model config of conf/model/ loaded as the stages load it, instead of random widths."""
    device = torch.device(device)
    weights = None
    if model_name is not None:
        model, vocab, weights = load_named(model_name, str(dtype).removeprefix("torch."))
        model = model.to(device)
        shape = {"model": model_name, "layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size}
    else:
        shape = dict(CPU_SHAPE if device.type == "cpu" else CUDA_SHAPE) if shape is None else dict(shape)
        vocab = shape.pop("vocab_size", VOCAB)
        model = build_tiny_model(vocab, seed=seed, dtype=dtype, device=device, **shape).eval()
    hf_model = copy.deepcopy(model)  # same weights; transformers' own attention for its own generate
    hf_model.config._attn_implementation = "sdpa"
    hf_model.generation_config.top_k = None
    if rows % group:
        raise ValueError(f"rows={rows} must be a multiple of group={group}")
    prompts = [p for p in _prompts(rows // group, prompt, min(vocab, 50_000), seed) for _ in range(group)]
    methods = _methods(model, hf_model, prompts, new, greedy, device, compile)
    seconds = {name: [] for name in methods}
    for round_ in range(repeats + 1):  # round 0 warms up (and compiles, where compiling)
        for name, run in methods.items():
            _sync(device)
            started = time.perf_counter()
            tokens = run(seed + round_)
            _sync(device)
            elapsed = time.perf_counter() - started
            if tokens != rows * new:
                raise RuntimeError(f"{name} generated {tokens} tokens, expected {rows} x {new}: eos must be disabled")
            if round_:
                seconds[name].append(elapsed)
    table = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        table[name] = {"tokens_per_second": rows * new / median, "tokens_per_second_best": rows * new / min(times),
                       "seconds_median": median, "seconds": times}
    reference, best = table[REFERENCE]["tokens_per_second"], table[REFERENCE]["tokens_per_second_best"]
    for row in table.values():
        row["ratio_to_hf_static"] = row["tokens_per_second"] / reference
        row["ratio_to_hf_static_best"] = row["tokens_per_second_best"] / best
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
        "shape": {**shape, "vocab_size": vocab}, "rows": rows, "group": group, "prompt": prompt, "new_tokens": new, "repeats": repeats,
        "sampling": "greedy" if greedy else "temperature 1", "compile": compile, "methods": table, "weights": weights,
    }


def graph_check(device="cuda", shape: dict | None = None, dtype=torch.float32, rows: int = 8, prompt: int = 128, new: int = 32,
                seed: int = 0) -> dict:
    """Our evicting rollouts with the decode step captured as CUDA graphs (`compile=True`) against eager ones
    (`compile=False`), greedy, ragged prompts (left padding): per policy, whether the capture held (no fallback
    warning), the fraction of rows with identical tokens, the largest log-prob difference, and whether the
    shadow masks are identical. ok: every capture held and every row is identical."""
    from smd_cli.eviction.h2o import H2O

    device = torch.device(device)
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device", "ok": True}
    shape = dict(CUDA_SHAPE if shape is None else shape)
    vocab = shape.pop("vocab_size", VOCAB)
    model = build_tiny_model(vocab, seed=seed, dtype=dtype, device=device, **shape).eval()
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, min(vocab, 50_000), (prompt - 5 * i,), generator=generator).tolist() for i in range(rows)]
    policies = {"snapkv": lambda: SnapKV(0.5, sink=4, window=16), "h2o": lambda: H2O(0.5, sink=0, window=16),
                "snapkv_recompress": lambda: SnapKV(0.5, sink=4, window=8, recompress_every=16)}
    out = {}
    for name, make in policies.items():
        runs, fallbacks = {}, []
        for compile in (False, True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runs[compile] = generate(model, prompts, policy=make(), max_new_tokens=new, temperature=0.0, eos_token_id=-1,
                                         pad_token_id=0, measure_dense_kv=False, compile=compile)
            fallbacks += [str(w.message) for w in caught if "CUDA-graph" in str(w.message)]
        eager, graphed = runs[False], runs[True]
        out[name] = {"capture_fallbacks": fallbacks,
                     "rows_identical": float((eager.input_ids == graphed.input_ids).all(-1).float().mean()),
                     "logp_max_abs_diff": float((eager.logprobs - graphed.logprobs).abs().max()),
                     "evict_at_identical": bool(torch.equal(eager.evict_at, graphed.evict_at))}
    out["ok"] = all(not v["capture_fallbacks"] and v["rows_identical"] == 1.0 for v in out.values() if isinstance(v, dict))
    return out


def load_named(name: str, dtype: str = "float32"):
    """(model, vocabulary size) of the model config `name` (e.g. smollm2_135m: the real SmolLM2-135M-Instruct, the
    dequantised GGUF offline), through the stages' own `load_model`; and which weights those are."""
    import tempfile

    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.factories import build_task
    from smd_cli.runs.model_loading import load_model, weights_label

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="rollout", overrides=[f"model={name}", f"model.dtype={dtype}", "task=passkey", "device=cpu", "progress=false",
                                                        "threads=null", f"+run_dir={tmp}"])
        model, tokenizer = load_model(cfg, build_task(cfg), torch.device("cpu"))
    return model.eval(), model.config.vocab_size, weights_label(model)


def format_table(report: dict) -> str:
    title = (f"decode speed on {report['device']} ({report['threads']} thread(s), {report['dtype']}): {report['rows']} rows "
             f"({report.get('group', 1)} per prompt), "
             f"P = {report['prompt']}, {report['new_tokens']} new tokens, {report['sampling']}, median of {report['repeats']}")
    if report.get("weights"):
        title += f"\nmodel: {report['weights']}"
    lines = [title, f"{'method':<16} {'tokens/s':>10} {'x hf static':>12} {'best tokens/s':>14} {'x hf static':>12}"]
    for name, row in report["methods"].items():
        lines.append(f"{name:<16} {row['tokens_per_second']:>10.0f} {row['ratio_to_hf_static']:>12.2f} "
                     f"{row['tokens_per_second_best']:>14.0f} {row['ratio_to_hf_static_best']:>12.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a model config (conf/model/NAME.yaml), e.g. smollm2_135m; default: random widths")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--new", type=int)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--group", type=int, default=1, help="rows per prompt (GRPO's G samples; our rollout prefills each prompt once)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--greedy", action="store_true", help="argmax instead of sampling at temperature 1")
    parser.add_argument("--compile", default="auto", choices=["auto", "true", "false"], help="our generate's `compile` option")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "decode_speed.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    report = measure(device, dtype=torch.bfloat16 if cuda else torch.float32, rows=args.rows or (64 if cuda else 16),
                     prompt=args.prompt or (512 if cuda else 256), new=args.new or (128 if cuda else 64), repeats=args.repeats,
                     greedy=args.greedy, compile={"true": True, "false": False}.get(args.compile, "auto"), group=args.group,
                     model_name=args.model)
    report["command"] = " ".join(["python", "bench/decode_speed.py", *sys.argv[1:]])
    print(format_table(report))
    if cuda:
        report["graph_check"] = graph_check(device)
        print("graph check:", json.dumps(report["graph_check"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_file(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
