"""`smd plan`'s predictions against measured live tensor bytes, phase by phase, at several sizes.

For each size: a Qwen3 of the given widths (random weights, gradient checkpointing on, float32 on the CPU),
one evicting rollout (SnapKV, c = 0.5) of `rows` prompts of P tokens (left-padded) and R new tokens, then
`learner_step`s of naive_sparse and smd (one warm-up step so that gradients and optimizer state exist).
Measured: the static bytes (weights, gradients, optimizer state: the storages themselves), the rollout's
and each learner step's peak of live tensor bytes above what was held before (`profiler.live_tensor_peak`).
Prints predicted / measured per phase, and the learner's SMD / naive_sparse dynamic-memory ratio.

    python bench/plan_check.py                      # the suite's sizes (small widths, fast)
    python bench/plan_check.py --paper              # the paper's widths and vocabulary, 2 layers (~15 minutes);
                                                    # also the rollout peak's growth with P (no [P, P] term)
    python bench/plan_check.py --long               # SmolLM2-135M's widths (4 layers) at P = 1024, 2048, 4096: the learner's
                                                    # SMD / naive_sparse ratio and the planner's error at long prompts
    python bench/plan_check.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.checks.planner import Arch, Run, plan  # noqa: E402
from smd_cli.checks.profiler import live_tensor_peak  # noqa: E402
from smd_cli.eviction.snapkv import SnapKV  # noqa: E402
from smd_cli.learner.step import Algorithm, learner_step  # noqa: E402
from smd_cli.model.build import build_tiny_model, enable_checkpointing  # noqa: E402
from smd_cli.model.precision import build_optimizer  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402

PAPER = dict(hidden=2560, intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936)
# (layers, P, R, rows, widths): the suite's sizes span prompt-, response- and vocabulary-dominated regimes
SMALL = [
    (2, 256, 32, 4, dict(hidden=256, intermediate=1024, heads=8, kv_heads=2, head_dim=32, vocab=8192)),
    (2, 512, 16, 2, dict(hidden=512, intermediate=2048, heads=8, kv_heads=2, head_dim=64, vocab=4096)),
    (1, 128, 64, 4, dict(hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=32768)),
    (1, 128, 64, 1, dict(hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=32768)),  # one row: the CPU's padded head
]
PAPER_SIZES = [(2, 1024, 64, 4, PAPER)]
# SmolLM2-135M's widths and vocabulary, 4 of its 30 layers (memory per layer is what grows with P), at long prompts
SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)
LONG_SIZES = [(4, P, 64, 4, SMOLLM2) for P in (1024, 2048, 4096)]
WINDOW, SINK = 16, 4


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def optimizer_tensors(optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        yield from (v for v in state.values() if torch.is_tensor(v))
    for _, master in getattr(optimizer, "pairs", []):
        yield master
        yield master.grad


def measure(layers: int, P: int, R: int, rows: int, widths: dict, seed: int = 0) -> dict:
    arch = Arch(layers=layers, **widths)
    model = build_tiny_model(arch.vocab, seed=seed, num_hidden_layers=layers, hidden_size=arch.hidden,
                             intermediate_size=arch.intermediate, num_attention_heads=arch.heads,
                             num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim).eval()
    enable_checkpointing(model)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, arch.vocab, (P - 5 * i,), generator=generator).tolist() for i in range(rows)]
    policy = SnapKV(compression=0.5, sink=SINK, window=WINDOW)
    with live_tensor_peak() as rollout:
        batch = generate(model, prompts, policy=policy, max_new_tokens=R, generator=generator, eos_token_id=-1, pad_token_id=0,
                         measure_dense_kv=False)
    out = {"size": f"L{layers} P{P} R{R} rows{rows} hidden{arch.hidden} vocab{arch.vocab}", "measured": {}, "predicted": {}}
    kept = int(policy.budget(torch.tensor([P]))[0])
    advantages = torch.randn(rows, generator=generator)
    for name in ("naive_sparse", "smd"):
        optimizer = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-6, fused=True))
        learner_step(model, optimizer, batch, advantages, Algorithm(name))  # gradients and optimizer state now exist
        with live_tensor_peak() as learner:
            learner_step(model, optimizer, batch, advantages, Algorithm(name))
        static = storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *optimizer_tensors(optimizer)])
        run = Run(arch=arch, compute_bytes=4, device="cpu", algo=name, rows=rows, micro_batch=rows, rollout_rows=rows,
                  prompt=P, response=R, kept=kept, cache_growth=R - 1, score_rows=WINDOW)
        predicted = plan(run)
        if name == "naive_sparse":
            out["measured"]["static"], out["predicted"]["static"] = static, predicted.static_bytes
            out["measured"]["rollout"], out["predicted"]["rollout"] = rollout.peak, predicted.rollout["peak"]
        out["measured"][f"learner {name}"], out["predicted"][f"learner {name}"] = learner.peak, predicted.learner["peak"]
        del optimizer
    out["smd_over_naive_sparse"] = out["measured"]["learner smd"] / out["measured"]["learner naive_sparse"]
    out["ratios"] = {k: out["predicted"][k] / out["measured"][k] for k in out["measured"]}
    return out


def prefill_scaling(widths: dict, rows: int = 4, prompts=(512, 1024, 2048)) -> dict:
    """The rollout's peak at growing P (one layer, 2 new tokens): fit peak = a P + b P^2 and compare b with
    what a [rows, 1, P, P] float mask per layer (the old prefill) would cost per P^2."""
    arch = Arch(layers=1, **widths)
    model = build_tiny_model(arch.vocab, num_hidden_layers=1, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                             num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim).eval()
    peaks = []
    for P in prompts:
        generator = torch.Generator().manual_seed(0)
        batch_prompts = [torch.randint(3, arch.vocab, (P - 5 * i,), generator=generator).tolist() for i in range(rows)]
        with live_tensor_peak() as live:
            generate(model, batch_prompts, policy=SnapKV(0.5, sink=SINK, window=WINDOW), max_new_tokens=2, generator=generator,
                     eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
        peaks.append(live.peak)
    x = torch.tensor([[float(P), float(P) ** 2, 1.0] for P in prompts], dtype=torch.float64)
    a, b, c = torch.linalg.solve(x, torch.tensor(peaks, dtype=torch.float64)).tolist()
    return {"prompt_widths": list(prompts), "rollout_peak_bytes": peaks, "bytes_per_prompt_token": a, "bytes_per_prompt_token_squared": b,
            "a_float_P_by_P_mask_per_layer_would_be": 4.0 * rows}


def learner_scaling(results: list[dict]) -> dict:
    """Each learner's measured peak per token of T = P + R at each size, and its growth from one size to the next
    against T's: linear memory grows as T does (a little less: fixed terms), a [T, T] term per layer would grow as T^2."""
    widths = [int(r["size"].split(" P")[1].split()[0]) + int(r["size"].split(" R")[1].split()[0]) for r in results]
    out = {"widths": widths, "t_growth": [b / a for a, b in zip(widths, widths[1:])]}
    for name in ("naive_sparse", "smd"):
        peaks = [r["measured"][f"learner {name}"] for r in results]
        out[name] = {"bytes_per_token": [p / t for p, t in zip(peaks, widths)], "growth": [b / a for a, b in zip(peaks, peaks[1:])]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="the paper's widths and vocabulary, 2 layers")
    parser.add_argument("--long", action="store_true", help="SmolLM2-135M's widths, 4 layers, P = 1024, 2048, 4096 (issue 41 item 2)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure(*size) for size in (PAPER_SIZES if args.paper else LONG_SIZES if args.long else SMALL)]
    if args.long:  # the learner's peak against T: linear, or a [T, T] term per layer (growth as T^2)
        results.append({"learner_scaling": learner_scaling(results)})
        fit = results[-1]["learner_scaling"]
        print(f"learner peak at T = {fit['widths']} (T grows {', '.join(f'{g:.2f}x' for g in fit['t_growth'])}): "
              + "; ".join(f"{k} {', '.join(f'{b / 2**10:.1f}' for b in fit[k]['bytes_per_token'])} KiB a token, grows "
                          f"{', '.join(f'{g:.2f}x' for g in fit[k]['growth'])}" for k in ("naive_sparse", "smd")))
    if args.paper:
        scaling = prefill_scaling({**PAPER, "vocab": 4096})
        print(f"rollout peak at P = {scaling['prompt_widths']}: {[round(p / 2**20, 1) for p in scaling['rollout_peak_bytes']]} MiB;"
              f" fit a P + b P^2: a = {scaling['bytes_per_prompt_token'] / 2**10:.1f} KiB, b = {scaling['bytes_per_prompt_token_squared']:.3f}"
              f" B (a [rows, 1, P, P] float mask per layer: {scaling['a_float_P_by_P_mask_per_layer_would_be']:.0f} B)")
        results.append({"prefill_scaling": scaling})
    for r in results:
        if "size" not in r:
            continue
        print(r["size"])
        for phase, measured in r["measured"].items():
            print(f"  {phase:22s} measured {measured / 2**20:10.1f} MiB  predicted {r['predicted'][phase] / 2**20:10.1f} MiB"
                  f"  predicted/measured {r['ratios'][phase]:.3f}")
        print(f"  learner dynamic memory, smd / naive_sparse: {r['smd_over_naive_sparse']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
