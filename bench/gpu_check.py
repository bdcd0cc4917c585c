"""The paper-scale checks that need a GPU, as one prepared run (`bench/gpu_check.sh OUTDIR`). `--cpu` runs the very
same checks on the CPU with the very same model configs, Qwen3-4B's (conf/model/qwen3_4b_random.yaml, vocabulary
included) at one layer instead of four or 36, and fewer rows (about two minutes on two cores: run it before a GPU
session); `--cpu --narrow` runs them at narrow widths in seconds: that is how the suite tests this script, so the code
the GPU run executes is the code its CPU test executes (`checks` builds all three; a test compares them).

1. flex replay parity: the shadow replay through compiled `flex_attention` (the CUDA backend; the CPU's inductor
   compiles it too) against the SDPA replay, and both against the sampler's log-probs, on GRPO rows (each prompt
   twice: the learner computes a prompt once and replays the response rows alone) and on distinct prompts, in
   float32 and bfloat16; forward and backward on CUDA (the CPU has no flex backward: forward only).
2. one learner step each of naive_sparse and smd, bf16 compute over float32 masters on CUDA (float32 on the CPU,
   `model.cpu_dtype`), gradient checkpointing: each phase's measured peak (CUDA allocator; live tensors on the
   CPU) beside `smd plan`'s prediction, and SMD's learner over naive_sparse's (DESIGN.md contract 3: <= 1.05).
3. decode speed (`bench/decode_speed.py`'s measurement): tokens per second of the dense and the evicting (SnapKV)
   rollouts against transformers' `generate` with a dynamic and a static cache, same model and shapes; on CUDA
   also the evicting rollout without CUDA graphs, and the CUDA-graph decode against the eager one, token for token.
4. optim=adamw8bit: one step with bitsandbytes' 8-bit AdamW over the float32 masters (CUDA only).
5. optim.offload: the masters, their gradients and AdamW's state to pinned host memory and back, bit for bit, and
   the seconds it takes (CUDA only: the CPU twin is tests/test_offload.py's).

Writes OUTDIR/gpu_check.json (every number, the model config of each check, and `ok` per check) and exits 1 if a
check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.attention import shadow  # noqa: E402
from smd_cli.checks.planner import Arch, Run, plan  # noqa: E402
from smd_cli.checks.profiler import live_tensor_peak  # noqa: E402
from smd_cli.eviction.snapkv import SnapKV  # noqa: E402
from smd_cli.learner.forward import response_hidden, vocab_terms  # noqa: E402
from smd_cli.learner.losses import group_advantages  # noqa: E402
from smd_cli.learner.step import Algorithm, learner_step  # noqa: E402
from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer, enable_checkpointing  # noqa: E402
from smd_cli.model.precision import build_optimizer  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402
from smd_cli.runtime.offload import Offload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def qwen3_4b() -> dict:
    """Qwen3-4B-Instruct-2507's architecture: the fields `model=qwen3_4b_random` builds (conf/model/qwen3_4b_random.yaml)."""
    return dict(yaml.safe_load((ROOT / "conf" / "model" / "qwen3_4b_random.yaml").read_text())["config"])


def build(widths: dict, tokenizer, seed: int, dtype, device):
    """The model of `widths` as `smd_cli.runs.model_loading.load_model` builds `model.config` (its own vocabulary wins)."""
    fields = {"vocab_size": len(tokenizer), **widths}
    return build_tiny_model(fields.pop("vocab_size"), seed=seed, dtype=dtype, device=device, draw_once=True, **fields).eval()


def prompts_for(tokenizer, prompts: int, width: int, vocab: int, repeats: int = 1, seed: int = 0) -> list[list[int]]:
    """GSM8K questions (the shared copy) cut to `width` tokens, else random ids; lengths vary (left padding); each
    prompt `repeats` times in a row (GRPO's samples)."""
    if GSM8K.is_file():
        texts = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:prompts]]
        distinct = [tokenizer(t)["input_ids"][: width - 3 * i] or [5] for i, t in enumerate(texts)]
    else:
        generator = torch.Generator().manual_seed(seed)
        distinct = [torch.randint(3, min(vocab, 500), (width - 3 * i,), generator=generator).tolist() for i in range(prompts)]
    return [p for p in distinct for _ in range(repeats)]


def flex_parity(device, dtype, widths, prompts: int, width: int, new: int) -> dict:
    tokenizer = build_tiny_tokenizer()
    model = build(widths, tokenizer, 1, dtype, device)
    head = model.get_output_embeddings()
    backward = device.type == "cuda"
    out = {}
    for layout, repeats in (("grpo_rows", 2), ("distinct", 1)):
        batch = generate(model, prompts_for(tokenizer, prompts, width, len(tokenizer), repeats), policy=SnapKV(0.5, sink=4, window=8),
                         max_new_tokens=new, generator=torch.Generator(device=device).manual_seed(0), eos_token_id=-1, pad_token_id=0,
                         measure_dense_kv=False)
        tokens, mask = batch.input_ids[:, batch.prompt_length:], batch.response_mask
        logps, grads = {}, {}
        for backend in ("sdpa", "flex"):
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(backward), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.train(backward)
                hidden = response_hidden(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at, backend)
                logp = vocab_terms(head, hidden, tokens, mask)["logp"]
                if backward:
                    (logp * mask).sum().backward()
                    grads[backend] = [p.grad.float().clone() for p in model.parameters()]
            model.eval()
            logps[backend] = logp.detach()
            out[f"{layout}/{backend}_vs_sampler_max_abs"] = float((logps[backend] - batch.logprobs)[mask].abs().max())
            out[f"{layout}/{backend}_warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
        out[f"{layout}/flex_vs_sdpa_max_abs"] = float((logps["flex"] - logps["sdpa"])[mask].abs().max())
        if grads:
            out[f"{layout}/grad_flex_vs_sdpa_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(grads["flex"], grads["sdpa"]))
            out[f"{layout}/grad_scale"] = max(float(g.abs().max()) for g in grads["sdpa"])
    out["flex_failure"] = shadow.flex_failure()  # a compile that failed (the replay then ran on SDPA)
    bound = 1e-4 if dtype == torch.float32 else 0.1
    out["ok"] = out["flex_failure"] is None and all(
        out[f"{layout}/flex_vs_sdpa_max_abs"] <= bound
        and out.get(f"{layout}/grad_flex_vs_sdpa_max_abs", 0.0) <= bound * max(1.0, out.get(f"{layout}/grad_scale", 1.0))
        for layout in ("grpo_rows", "distinct"))
    return out


def prime(optimizer) -> None:
    """Allocate the gradients and the optimizer's state before a measurement (they are static memory): one step on
    zero gradients, which moves no weight (AdamW's first moment is then 0; no weight decay)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()


def learner_phases(device, widths, rows, P, R, micro, dtype, optimizer: str = "adamw") -> dict:
    tokenizer = build_tiny_tokenizer()
    model = build(widths, tokenizer, 0, dtype, device)
    enable_checkpointing(model)
    prompts = prompts_for(tokenizer, rows // 2, P, len(tokenizer), repeats=2)
    policy = SnapKV(compression=0.5, sink=4, window=64 if device.type == "cuda" else 8)
    fields = {"vocab_size": len(tokenizer), **widths}
    arch = Arch(layers=fields["num_hidden_layers"], hidden=fields["hidden_size"], intermediate=fields["intermediate_size"],
                heads=fields["num_attention_heads"], kv_heads=fields["num_key_value_heads"], head_dim=fields["head_dim"],
                vocab=fields["vocab_size"])
    make = {"adamw": lambda params: torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=True),
            "sgd": lambda params: torch.optim.SGD(params, lr=1e-6)}
    out = {"optimizer": optimizer}
    for name in ("naive_sparse", "smd"):
        built = build_optimizer(model, make[optimizer])
        prime(built)
        with live_tensor_peak(device) as rollout:
            batch = generate(model, prompts, policy=policy, max_new_tokens=R, generator=torch.Generator(device=device).manual_seed(0),
                             eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
        advantages = group_advantages(torch.randn(rows, generator=torch.Generator().manual_seed(1)), 2).to(device)
        with live_tensor_peak(device) as learner:
            started = time.perf_counter()
            metrics = learner_step(model, built, batch, advantages, Algorithm(name, micro_batch_size=micro))
            seconds = time.perf_counter() - started
        run = Run(arch=arch, compute_bytes=2 if dtype == torch.bfloat16 else 4, device=device.type, algo=name, rows=rows,
                  micro_batch=micro, rollout_rows=rows, prompt=batch.prompt_length, response=R,
                  kept=int(policy.budget(torch.tensor([batch.prompt_length]))[0]), cache_growth=R - 1, score_rows=policy.window)
        predicted = plan(run)
        out[name] = {"rollout_peak_bytes": rollout.peak, "rollout_predicted_bytes": predicted.rollout["peak"],
                     "learner_peak_bytes": learner.peak, "learner_predicted_bytes": predicted.learner["peak"],
                     "static_predicted_bytes": predicted.static_bytes, "learner_seconds": seconds,
                     "mismatch_max_abs_diff": metrics["mismatch/max_abs_diff"], "loss": metrics["loss"]}
        if hasattr(built, "close"):  # float32 masters: their gradient hooks go with them
            built.close()
        del built
    out["smd_over_naive_sparse_learner"] = out["smd"]["learner_peak_bytes"] / out["naive_sparse"]["learner_peak_bytes"]
    out["ok"] = all(torch.isfinite(torch.tensor(out[n]["loss"])) for n in ("naive_sparse", "smd")) and out["smd_over_naive_sparse_learner"] <= 1.05
    return out


def decode_speed(device, widths, dtype, rows, P, R, repeats) -> dict:
    from decode_speed import graph_check, measure  # bench/decode_speed.py (this script's folder is on sys.path)

    report = measure(device, shape=widths, dtype=dtype, rows=rows, prompt=P, new=R, repeats=repeats)
    keys = {name: name.removeprefix("smd ").replace(" ", "_") for name in report["methods"]}  # dense, snapkv, hf_static...
    out = {f"{keys[name]}_tokens_per_second": row["tokens_per_second"] for name, row in report["methods"].items()}
    out.update({f"{keys[name]}_over_hf_static": row["ratio_to_hf_static"] for name, row in report["methods"].items()})
    out["report"] = report
    out["graph_check"] = graph_check(device, shape=widths)
    out["ok"] = out["graph_check"]["ok"]
    return out


def adamw8bit(device, widths, dtype) -> dict:
    if device.type != "cuda":
        return {"skipped": "bitsandbytes' 8-bit AdamW keeps its state on a CUDA device", "ok": True}
    import bitsandbytes as bnb

    tokenizer = build_tiny_tokenizer()
    model = build(widths, tokenizer, 0, dtype, device)
    optimizer = build_optimizer(model, lambda params: bnb.optim.AdamW8bit(params, lr=1e-6))
    batch = generate(model, prompts_for(tokenizer, 4, 128, len(tokenizer), repeats=2), policy=SnapKV(0.5), max_new_tokens=16, eos_token_id=-1,
                     pad_token_id=0, measure_dense_kv=False)
    before = [m.detach().clone() for _, m in optimizer.pairs]
    metrics = learner_step(model, optimizer, batch, group_advantages(torch.randn(8), 2).to(device), Algorithm("smd"))
    moved = min(float((m.detach() != b).float().mean()) for (_, m), b in zip(optimizer.pairs, before) if b.dim() == 2)
    return {"loss": metrics["loss"], "min_fraction_of_master_entries_moved": moved, "ok": moved > 0.5}


def offload(device, widths, dtype) -> dict:
    if device.type != "cuda":
        return {"skipped": "pinned host memory needs CUDA; the CPU twin runs in tests/test_offload.py", "ok": True}
    tokenizer = build_tiny_tokenizer()
    model = build(widths, tokenizer, 0, dtype, device)
    optimizer = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-6, fused=True))
    prime(optimizer)
    moving = Offload(optimizer, device)
    before = {key: t.clone() for key, t in moving.tensors().items()}
    held = torch.cuda.memory_allocated(device)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    moving.to_host()
    to_host = time.perf_counter() - started
    freed = held - torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    moving.to_device()
    torch.cuda.synchronize(device)
    to_device = time.perf_counter() - started
    same = all(torch.equal(t, before[key]) for key, t in moving.tensors().items())
    moved = sum(t.nbytes for t in before.values())
    return {"bytes_moved": moved, "device_bytes_freed": freed, "to_host_seconds": to_host, "to_device_seconds": to_device,
            "to_host_GB_per_second": moved / to_host / 1e9, "to_device_GB_per_second": moved / to_device / 1e9,
            "bit_for_bit": same, "pinned": all(b.is_pinned() for b in moving.host.values()), "ok": same and freed >= 0.99 * moved}


NARROW = {"vocab_size": 16384, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 64}  # `--narrow`: Qwen3-4B's config at these widths (grouped queries, tied embeddings, its RoPE kept)


def checks(cpu: bool, narrow: bool = False) -> dict[str, tuple]:
    """name -> (function, keyword arguments) of each check: the GPU's, or `cpu`'s, which differ in depth, rows, widths
    of the prompts and compute dtype (the CPU computes in float32, `model.cpu_dtype`), never in the model's widths;
    `narrow` (CPU only): the same checks at `NARROW` widths, every line of this script in seconds (the suite's run)."""
    def model(layers: int) -> dict:
        return {**qwen3_4b(), "num_hidden_layers": layers, **(NARROW if narrow else {})}

    if cpu:
        device, f32 = torch.device("cpu"), torch.float32
        return {
            "flex_parity_float32": (flex_parity, dict(device=device, dtype=f32, widths=model(1), prompts=2, width=48, new=4)),
            "flex_parity_bfloat16": (flex_parity, dict(device=device, dtype=torch.bfloat16, widths=model(1), prompts=2, width=48, new=4)),
            # SGD: AdamW's 8 bytes per parameter (3.9 GB at one layer of these widths) are static memory, outside what
            # this check measures, and too much for a shared CPU machine
            "learner_phases": (learner_phases, dict(device=device, widths=model(1), rows=4, P=40, R=4, micro=4, dtype=f32, optimizer="sgd")),
            "decode_speed": (decode_speed, dict(device=device, widths=model(1), dtype=f32, rows=2, P=32, R=4, repeats=1)),
            "adamw8bit": (adamw8bit, dict(device=device, widths=model(1), dtype=f32)),
            "offload": (offload, dict(device=device, widths=model(1), dtype=f32)),
        }
    device, bf16 = torch.device("cuda"), torch.bfloat16
    return {
        "flex_parity_float32": (flex_parity, dict(device=device, dtype=torch.float32, widths=model(4), prompts=4, width=512, new=32)),
        "flex_parity_bfloat16": (flex_parity, dict(device=device, dtype=bf16, widths=model(4), prompts=4, width=512, new=32)),
        "learner_phases": (learner_phases, dict(device=device, widths=model(36), rows=16, P=512, R=256, micro=8, dtype=bf16, optimizer="adamw")),
        "decode_speed": (decode_speed, dict(device=device, widths=model(4), dtype=bf16, rows=64, P=512, R=128, repeats=3)),
        "adamw8bit": (adamw8bit, dict(device=device, widths=model(4), dtype=bf16)),
        "offload": (offload, dict(device=device, widths=model(4), dtype=bf16)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="the same checks on the CPU at one layer (tests this script without a GPU)")
    parser.add_argument("--narrow", action="store_true", help="with --cpu: at narrow widths (NARROW), seconds instead of minutes")
    parser.add_argument("--only", nargs="*", help="run these checks only (names as in gpu_check.json)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu to check the script itself")
    if args.narrow and not args.cpu:
        sys.exit("--narrow is a CPU mode: use it with --cpu")
    if args.cpu:
        torch.set_num_threads(2)
    planned = {name: check for name, check in checks(args.cpu, args.narrow).items() if not args.only or name in args.only}
    device = torch.device("cpu" if args.cpu else "cuda")
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (check, kwargs) in planned.items():
        started = time.perf_counter()
        try:
            report[name] = check(**kwargs)
        except Exception as err:  # report every check, then fail at the end
            report[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        report[name]["seconds"] = time.perf_counter() - started
        report[name]["model"] = kwargs["widths"]
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']:.1f} s)", flush=True)
        write_file(args.out / "gpu_check.json", json.dumps(report, indent=2, default=float))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sys.exit(0 if all(v["ok"] for k, v in report.items() if isinstance(v, dict)) else 1)


if __name__ == "__main__":
    main()
