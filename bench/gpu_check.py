"""The paper-scale checks that need a GPU, as one prepared run (`bench/gpu_check.sh OUTDIR`; `--cpu` runs the
same checks at tiny shapes on the CPU, which is how the suite tests this script).

1. flex replay parity: the shadow replay through `flex_attention` (the CUDA backend) against the SDPA replay
   (and both against the sampler's log-probs), forward and backward, in float32 and bfloat16 (on the CPU
   flex has no backward: forward only).
2. one learner step each of naive_sparse and smd on `qwen3_4b_random` (all 36 layers on CUDA) with the gsm8k
   recipe's shapes and fewer rows, bf16 compute with float32 masters, gradient checkpointing: each phase's
   measured peak (CUDA allocator) beside `smd plan`'s prediction.
3. decode speed (`bench/decode_speed.py`'s measurement): tokens per second of the dense and the evicting (SnapKV)
   rollouts against transformers' `generate` with a dynamic and a static cache, same model and shapes; on CUDA
   also the evicting rollout without CUDA graphs, and the CUDA-graph decode against the eager one, token for token.
4. optim=adamw8bit: one step with bitsandbytes' 8-bit AdamW over the float32 masters (CUDA only).

Writes OUTDIR/gpu_check.json (every number, and `ok` per check) and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.eviction.snapkv import SnapKV  # noqa: E402
from smd_cli.learner import Algorithm, learner_step  # noqa: E402
from smd_cli.losses import group_advantages  # noqa: E402
from smd_cli.models import build_tiny_model, build_tiny_tokenizer, enable_checkpointing  # noqa: E402
from smd_cli.planner import Arch, Run, plan  # noqa: E402
from smd_cli.precision import build_optimizer  # noqa: E402
from smd_cli.profiler import live_tensor_peak  # noqa: E402
from smd_cli.rollout import generate  # noqa: E402
from smd_cli.scoring import response_hidden, vocab_terms  # noqa: E402

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, rope_theta=5e6, max_position_embeddings=262144)
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def prompts_for(tokenizer, rows: int, width: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """GSM8K questions (the shared copy) cut to `width` tokens, else random ids; lengths vary (left padding)."""
    if GSM8K.is_file():
        lines = GSM8K.read_text().splitlines()[:rows]
        texts = [json.loads(line)["question"] for line in lines]
        return [tokenizer(t)["input_ids"][: width - 3 * i] or [5] for i, t in enumerate(texts)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 500), (width - 3 * i,), generator=generator).tolist() for i in range(rows)]


def flex_parity(device, dtype, widths) -> dict:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=1, dtype=dtype, device=device, **widths).eval()
    batch = generate(model, prompts_for(tokenizer, 4, 96, len(tokenizer)), policy=SnapKV(0.5, sink=4, window=8), max_new_tokens=12,
                     generator=torch.Generator(device=device).manual_seed(0), eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
    tokens, mask = batch.input_ids[:, batch.prompt_length:], batch.response_mask
    head = model.get_output_embeddings()
    out = {}
    grads = {}
    for backend in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        backward = device.type == "cuda"
        with torch.set_grad_enabled(backward):
            model.train(backward)
            hidden = response_hidden(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at, backend)
            logp = vocab_terms(head, hidden, tokens, mask)["logp"]
            if backward:
                (logp * mask).sum().backward()
                grads[backend] = [p.grad.float().clone() for p in model.parameters()]
        out[f"{backend}_vs_sampler_max_abs"] = float((logp.detach() - batch.logprobs)[mask].abs().max())
        out[f"logp_{backend}"] = logp.detach()
    out["flex_vs_sdpa_max_abs"] = float((out.pop("logp_flex") - out.pop("logp_sdpa"))[mask].abs().max())
    if grads:
        out["grad_flex_vs_sdpa_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(grads["flex"], grads["sdpa"]))
        out["grad_scale"] = max(float(g.abs().max()) for g in grads["sdpa"])
    bound = 1e-4 if dtype == torch.float32 else 0.1
    out["ok"] = out["flex_vs_sdpa_max_abs"] <= bound and out.get("grad_flex_vs_sdpa_max_abs", 0.0) <= bound * max(1.0, out.get("grad_scale", 1.0))
    return out


def learner_phases(device, widths, rows, P, R, micro, dtype) -> dict:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=0, dtype=dtype, device=device, **widths).eval()
    enable_checkpointing(model)
    prompts = prompts_for(tokenizer, rows, P, len(tokenizer))
    policy = SnapKV(compression=0.5, sink=4, window=64 if device.type == "cuda" else 8)
    arch = Arch(layers=widths["num_hidden_layers"], hidden=widths["hidden_size"], intermediate=widths["intermediate_size"],
                heads=widths["num_attention_heads"], kv_heads=widths["num_key_value_heads"], head_dim=widths["head_dim"],
                vocab=widths.get("vocab_size", len(tokenizer)))
    out = {}
    for name in ("naive_sparse", "smd"):
        optimizer = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-6, fused=True))
        with live_tensor_peak(device) as rollout:
            batch = generate(model, prompts, policy=policy, max_new_tokens=R, generator=torch.Generator(device=device).manual_seed(0),
                             eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
        advantages = group_advantages(torch.randn(rows, generator=torch.Generator().manual_seed(1)), rows // 2).to(device)
        algo = Algorithm(name, micro_batch_size=micro)
        learner_step(model, optimizer, batch, advantages, algo)  # optimizer state now exists
        with live_tensor_peak(device) as learner:
            started = time.perf_counter()
            metrics = learner_step(model, optimizer, batch, advantages, algo)
            seconds = time.perf_counter() - started
        run = Run(arch=arch, compute_bytes=2 if dtype == torch.bfloat16 else 4, device=device.type, algo=name, rows=rows,
                  micro_batch=micro, rollout_rows=rows, prompt=batch.prompt_length, response=R,
                  kept=int(policy.budget(torch.tensor([batch.prompt_length]))[0]), cache_growth=R - 1, score_rows=policy.window)
        predicted = plan(run)
        out[name] = {"rollout_peak_bytes": rollout.peak, "rollout_predicted_bytes": predicted.rollout["peak"],
                     "learner_peak_bytes": learner.peak, "learner_predicted_bytes": predicted.learner["peak"],
                     "static_predicted_bytes": predicted.static_bytes, "learner_seconds": seconds,
                     "mismatch_max_abs_diff": metrics["mismatch/max_abs_diff"], "loss": metrics["loss"]}
        del optimizer
    out["smd_over_naive_sparse_learner"] = out["smd"]["learner_peak_bytes"] / out["naive_sparse"]["learner_peak_bytes"]
    out["ok"] = all(torch.isfinite(torch.tensor(out[n]["loss"])) for n in ("naive_sparse", "smd"))
    return out


def decode_speed(device, widths, dtype, rows, P, R, repeats) -> dict:
    from decode_speed import graph_check, measure  # bench/decode_speed.py (this script's folder is on sys.path)

    report = measure(device, shape=widths, dtype=dtype, rows=rows, prompt=P, new=R, repeats=repeats)
    keys = {name: name.removeprefix("smd ").replace(" ", "_") for name in report["methods"]}  # dense, snapkv, hf_static...
    out = {f"{keys[name]}_tokens_per_second": row["tokens_per_second"] for name, row in report["methods"].items()}
    out.update({f"{keys[name]}_over_hf_static": row["ratio_to_hf_static"] for name, row in report["methods"].items()})
    out["report"] = report
    out["graph_check"] = graph_check(device, shape={**widths, "num_hidden_layers": min(widths["num_hidden_layers"], 4)})
    out["ok"] = out["graph_check"]["ok"]
    return out


def adamw8bit(device, widths, dtype) -> dict:
    if device.type != "cuda":
        return {"skipped": "bitsandbytes' 8-bit AdamW keeps its state on a CUDA device", "ok": True}
    import bitsandbytes as bnb

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=0, dtype=dtype, device=device, **widths).eval()
    optimizer = build_optimizer(model, lambda params: bnb.optim.AdamW8bit(params, lr=1e-6))
    batch = generate(model, prompts_for(tokenizer, 8, 128, len(tokenizer)), policy=SnapKV(0.5), max_new_tokens=16, eos_token_id=-1,
                     pad_token_id=0, measure_dense_kv=False)
    before = [m.detach().clone() for _, m in optimizer.pairs]
    metrics = learner_step(model, optimizer, batch, group_advantages(torch.randn(8), 4).to(device), Algorithm("smd"))
    moved = min(float((m.detach() != b).float().mean()) for (_, m), b in zip(optimizer.pairs, before) if b.dim() == 2)
    return {"loss": metrics["loss"], "min_fraction_of_master_entries_moved": moved, "ok": moved > 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (tests this script without a GPU)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu to check the script itself")
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        torch.set_num_threads(2)
        checks = {
            "flex_parity_float32": lambda: flex_parity(device, torch.float32, TINY),
            "flex_parity_bfloat16": lambda: flex_parity(device, torch.bfloat16, TINY),
            "learner_phases": lambda: learner_phases(device, TINY, rows=8, P=96, R=16, micro=4, dtype=torch.float32),
            "decode_speed": lambda: decode_speed(device, TINY, torch.float32, rows=8, P=128, R=32, repeats=1),
            "adamw8bit": lambda: adamw8bit(device, TINY, torch.float32),
        }
    else:
        narrow = {**QWEN3_4B, "num_hidden_layers": 4}
        checks = {
            "flex_parity_float32": lambda: flex_parity(device, torch.float32, narrow),
            "flex_parity_bfloat16": lambda: flex_parity(device, torch.bfloat16, narrow),
            "learner_phases": lambda: learner_phases(device, QWEN3_4B, rows=16, P=512, R=256, micro=8, dtype=torch.bfloat16),
            "decode_speed": lambda: decode_speed(device, {**QWEN3_4B, "num_hidden_layers": 4}, torch.bfloat16, rows=64, P=512, R=128,
                                                 repeats=3),
            "adamw8bit": lambda: adamw8bit(device, {**QWEN3_4B, "num_hidden_layers": 4}, torch.bfloat16),
        }
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, check in checks.items():
        started = time.perf_counter()
        try:
            report[name] = check()
        except Exception as err:  # report every check, then fail at the end
            report[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        report[name]["seconds"] = time.perf_counter() - started
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']:.1f} s)", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=float))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sys.exit(0 if all(v["ok"] for k, v in report.items() if isinstance(v, dict)) else 1)


if __name__ == "__main__":
    main()
