"""The learner's memory per algorithm and per view, measured side by side on one batch (DESIGN.md contract 3).

    .venv/bin/python bench/learner_memory.py                     # tiny widths, CPU (seconds)
    .venv/bin/python bench/learner_memory.py --paper             # the paper's widths and vocabulary, 2 layers (GB)
    .venv/bin/python bench/learner_memory.py --model smollm2_135m --prompt 227 --response 12 --rows 8 --group 4
                                                                 # a real model (conf/model/NAME.yaml) at the small scale's step
    .venv/bin/python bench/learner_memory.py --json out.json

One evicting rollout (SnapKV, c = 0.5) of `rows` prompts, then on that batch:
1. a whole `learner_step` of each algorithm (`smd_cli.learner.step.ALGORITHMS`), after a warm-up step
   so that gradients and optimizer state exist: the dynamic peak (live tensor bytes above what was held
   before the step) and the static bytes held (weights, gradients, optimizer state, and for Sparse-RL the
   frozen reference model its k3 KL term needs), each over naive_sparse's;
2. one forward + backward of the sum of the response log-probs in each learner view: dense, the shadow
   replay (SMD's view) and the physical-eviction learner (re-run the prefill, evict by slicing, teacher-force
   the response: the memory baseline the paper calls "not-in-place allocation spikes"), over dense's, on a
   SnapKV rollout and on an H2O one (decode-time eviction).
Peaks come from `smd_cli.checks.profiler.live_tensor_peak` (the CUDA allocator's peak on a GPU, the profiler's
allocation events on the CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.checks.profiler import live_tensor_peak  # noqa: E402
from smd_cli.eviction.h2o import H2O  # noqa: E402
from smd_cli.eviction.snapkv import SnapKV  # noqa: E402
from smd_cli.learner.forward import response_logits  # noqa: E402
from smd_cli.learner.physical import physical_response_logits  # noqa: E402
from smd_cli.learner.step import ALGORITHMS, Algorithm, learner_step  # noqa: E402
from smd_cli.model.build import build_tiny_model  # noqa: E402
from smd_cli.model.precision import build_optimizer  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.rollout.sampling import token_logprobs  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402

# TINY: a step of `make train` (16 prompts x 8 samples); PAPER: distinct prompts, as bench/plan_check.py --paper
TINY = dict(layers=2, hidden=64, intermediate=192, heads=4, kv_heads=2, head_dim=16, vocab=541, prompt=256, response=5, rows=128, group=8)
PAPER = dict(layers=2, hidden=2560, intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936, prompt=1024, response=64, rows=4,
             group=1)


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def static_bytes(model, optimizer, ref_model) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    masters = [t for _, m in getattr(optimizer, "pairs", []) for t in (m, m.grad)]
    ref = list(ref_model.parameters()) if ref_model is not None else []
    return storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *state, *masters, *ref])


def view_step(model, learner, batch, evict_at):
    def step():
        model.zero_grad(set_to_none=True)
        extra = () if evict_at is None else (evict_at,)
        logits = learner(model, batch.input_ids, batch.attention_mask, batch.prompt_length, *extra)
        logp = token_logprobs(logits, batch.input_ids[:, batch.prompt_length:])
        logp[batch.response_mask].sum().backward()

    return step


def measure(size: dict, device: str, seed: int = 0, model=None) -> dict:
    """`model`: a loaded model (its widths in `size`); None: a random one of `size`'s widths."""
    if model is None:
        model = build_tiny_model(size["vocab"], seed=seed, num_hidden_layers=size["layers"], hidden_size=size["hidden"],
                                 intermediate_size=size["intermediate"], num_attention_heads=size["heads"],
                                 num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"], device=device).eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    group = size.get("group", 1)  # rows per prompt: the learner and the prefill compute a prompt once for its rows
    distinct = [torch.randint(3, size["vocab"], (size["prompt"] - i % 8,), generator=torch.Generator().manual_seed(i)).tolist()
                for i in range(size["rows"] // group)]
    prompts = [p for p in distinct for _ in range(group)]
    batch = generate(model, prompts, policy=SnapKV(compression=0.5), max_new_tokens=size["response"], temperature=1.0,
                     generator=generator, eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
    advantages = torch.randn(size["rows"], generator=torch.Generator().manual_seed(seed + 1)).to(device)
    algorithms = {}
    for name in ALGORITHMS:
        trained = copy.deepcopy(model)
        algo = Algorithm(name, beta=1e-4 if name == "sparse_rl" else 0.0)  # Sparse-RL as its authors run it: a k3 KL
        ref_model = copy.deepcopy(model).requires_grad_(False).eval() if algo.beta > 0 else None
        optimizer = build_optimizer(trained, lambda params: torch.optim.AdamW(params, lr=1e-6))
        learner_step(trained, optimizer, batch, advantages, algo, ref_model)  # gradients and optimizer state now exist
        with live_tensor_peak(device) as live:
            learner_step(trained, optimizer, batch, advantages, algo, ref_model)
        algorithms[name] = {"dynamic_peak_bytes": live.peak, "static_bytes": static_bytes(trained, optimizer, ref_model)}
        del trained, optimizer, ref_model
    views = {}
    for policy_name, policy in (("snapkv", None), ("h2o", H2O(compression=0.5))):
        rollout = batch if policy is None else generate(model, prompts, policy=policy, max_new_tokens=size["response"], temperature=1.0,
                                                        generator=generator, eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
        views[policy_name] = {}
        for name, learner, evict_at in (("dense", response_logits, None), ("shadow", response_logits, rollout.evict_at),
                                        ("physical", physical_response_logits, rollout.evict_at)):
            view_step(model, learner, rollout, evict_at)()  # warm-up: gradients exist
            with live_tensor_peak(device) as live:
                view_step(model, learner, rollout, evict_at)()
            views[policy_name][name] = {"peak_bytes": live.peak}
    base = algorithms["naive_sparse"]
    for r in algorithms.values():
        r["dynamic_over_naive_sparse"] = r["dynamic_peak_bytes"] / base["dynamic_peak_bytes"]
        r["total_over_naive_sparse"] = (r["dynamic_peak_bytes"] + r["static_bytes"]) / (base["dynamic_peak_bytes"] + base["static_bytes"])
    for per_view in views.values():
        for r in per_view.values():
            r["over_dense"] = r["peak_bytes"] / per_view["dense"]["peak_bytes"]
    return {"size": size, "device": device, "kept_fraction": batch.stats["kv/kept_fraction"], "algorithms": algorithms, "views": views}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="the paper's widths and vocabulary (2 layers, P 1024, R 64, 4 rows)")
    parser.add_argument("--quick", action="store_true", help="a smaller batch (smoke test)")
    parser.add_argument("--model", default=None, help="a model config (conf/model/NAME.yaml), e.g. smollm2_135m; default: random widths")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: the size's)")
    parser.add_argument("--response", type=int, default=None, help="response tokens (default: the size's)")
    parser.add_argument("--rows", type=int, default=None, help="sequences in the batch (default: the size's)")
    parser.add_argument("--group", type=int, default=None, help="rows per prompt (default: the size's)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = dict(PAPER if args.paper else TINY)
    if args.quick:
        size.update(prompt=64, rows=8, group=min(size.get("group", 1), 4))
    size.update({k: v for k in ("prompt", "response", "rows", "group") if (v := getattr(args, k)) is not None})
    if size["rows"] % size["group"]:
        parser.error(f"--rows {size['rows']} must be a multiple of --group {size['group']}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = None
    if args.model:
        from decode_speed import load_named  # bench/decode_speed.py, beside this script

        model, vocab, weights = load_named(args.model)
        model = model.to(device)
        c = model.config
        size.update(layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=c.intermediate_size, heads=c.num_attention_heads,
                    kv_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                    vocab=vocab, model=args.model, weights=weights)
    result = measure(size, device, model=model)
    mib = 2.0**20
    print(f"learner memory, {device}: {size.get('weights') or 'random weights'}, {size['layers']} layers x {size['hidden']}, vocab {size['vocab']}, "
          f"{size['rows']} x (P {size['prompt']} + R {size['response']}), {size.get('group', 1)} row(s) per prompt, SnapKV c = 0.5 "
          f"(kept {result['kept_fraction']:.2f})")
    print(f"{'algorithm':14s} {'dynamic MiB':>12s} {'static MiB':>11s} {'dynamic / naive':>16s} {'total / naive':>14s}")
    for name, r in result["algorithms"].items():
        print(f"{name:14s} {r['dynamic_peak_bytes'] / mib:12.2f} {r['static_bytes'] / mib:11.2f} "
              f"{r['dynamic_over_naive_sparse']:16.3f} {r['total_over_naive_sparse']:14.3f}")
    for policy, per_view in result["views"].items():
        print(f"{'view, ' + policy:14s} {'peak MiB':>12s} {'/ dense':>11s}   (one forward + backward)")
        for name, r in per_view.items():
            print(f"{name:14s} {r['peak_bytes'] / mib:12.2f} {r['over_dense']:11.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
