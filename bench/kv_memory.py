"""KV memory at rollout, per eviction policy, measured side by side in one run (the learners' memory:
`bench/learner_memory.py`).

    .venv/bin/python bench/kv_memory.py                      # tiny scale, CPU, every conf/eviction/*.yaml
    .venv/bin/python bench/kv_memory.py --prompt 512 --new 64 --rows 8 --compression 0.7

Part 1 (DESIGN.md contract 4): for each policy, the rollout's peak KV bytes (storage nbytes of the cache's
key/value tensors, observed after every forward) next to a dense DynamicCache over the same tokens, their
ratio, and the kept fraction (entries held at the peak / entries a dense cache holds); plus the parity of
the shadow and physical learners with the sampler.

Part 2 (issue 28, `kv.quant`): for each policy, the peak KV bytes of the same rollout with a float32 cache, a bfloat16
one (the model run in bfloat16) and the 8-bit caches (int8, float8_e4m3: codes and their float32 scales, storage
bytes), side by side with their ratios to bf16 and fp32, the rounding record's bytes (a bit per element, on the host),
and the 8-bit rollouts' shadow parity (the learner reading keys and values as the cache held them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from smd_cli.learner.forward import response_logits  # noqa: E402
from smd_cli.learner.physical import physical_response_logits  # noqa: E402
from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from smd_cli.rollout.sampler import generate  # noqa: E402
from smd_cli.rollout.sampling import token_logprobs  # noqa: E402


def policies(compression: float, seed: int):
    for path in sorted((ROOT / "conf" / "eviction").glob("*.yaml")):
        cfg = OmegaConf.merge({"compression": compression, "seed": seed}, {"policy": OmegaConf.load(path)})
        yield path.stem, instantiate(cfg.policy)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256, help="longest prompt length (rows vary down to 3/4 of it)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated per row")
    parser.add_argument("--rows", type=int, default=8, help="rows in the batch (G samples of a few prompts)")
    parser.add_argument("--compression", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # on a shared small CPU, one thread is much faster for a tiny model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=args.seed).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.linspace(args.prompt * 3 // 4, args.prompt, args.rows).long().tolist()
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=generator).tolist() for n in lengths]
    console = Console(width=150)

    table = Table(title=f"KV cache at rollout: {args.rows} rows, prompts {lengths[0]}-{lengths[-1]}, {args.new} new tokens, c={args.compression}")
    for column in ("policy", "KV peak bytes", "dense bytes", "ratio", "kept fraction", "|ratio - kept|", "shadow diff", "physical diff", "dense diff"):
        table.add_column(column, justify="right")
    for name, policy in policies(args.compression, args.seed):
        batch = generate(model, prompts, policy=policy, max_new_tokens=args.new, generator=torch.Generator().manual_seed(args.seed),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        tokens, mask = batch.input_ids[:, batch.prompt_length:], batch.response_mask
        with torch.no_grad():
            diffs = [
                (token_logprobs(learner(), tokens) - batch.logprobs)[mask].abs().max().item()
                for learner in (
                    lambda: response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at),
                    lambda: physical_response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at),
                    lambda: response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length),
                )
            ]
        s = batch.stats
        ratio = s["kv/bytes_peak"] / s["kv/bytes_peak_dense"]
        table.add_row(name, f"{s['kv/bytes_peak']:,.0f}", f"{s['kv/bytes_peak_dense']:,.0f}", f"{ratio:.3f}", f"{s['kv/kept_fraction']:.3f}",
                      f"{abs(ratio - s['kv/kept_fraction']):.3f}", *(f"{d:.1e}" for d in diffs))
    console.print(table)
    quantised(model, prompts, args, tokenizer, console)


def quantised(model, prompts, args, tokenizer, console) -> None:
    """Part 2: the same rollout's KV bytes per cache format, measured from the cache's storages."""
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16)
    table = Table(title=f"8-bit KV cache (kv.quant): peak KV bytes, {args.rows} rows, c={args.compression}")
    for column in ("policy", "fp32", "bf16", "int8", "fp8_e4m3", "int8 / bf16", "int8 / fp32", "record (host)", "int8 shadow diff",
                   "fp8 shadow diff"):
        table.add_column(column, justify="right")
    for name, _ in policies(args.compression, args.seed):
        sizes, diffs, record = {}, [], 0
        for label, which, quant in (("fp32", model, "none"), ("bf16", half, "none"), ("int8", model, "int8"), ("fp8_e4m3", model, "fp8_e4m3")):
            policy = dict(policies(args.compression, args.seed))[name]  # fresh: the same random choices every time
            batch = generate(which, prompts, policy=policy, max_new_tokens=args.new, generator=torch.Generator().manual_seed(args.seed),
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False,
                             kv_quant=quant)
            sizes[label] = batch.stats["kv/bytes_peak"]
            if quant != "none":
                record = batch.kv_rounding.numel()
                with torch.no_grad():
                    logits = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at,
                                             quant=batch.cache_reads())
                diffs.append((token_logprobs(logits, batch.input_ids[:, batch.prompt_length:]) - batch.logprobs)[batch.response_mask]
                             .abs().max().item())
        table.add_row(name, *(f"{sizes[k]:,.0f}" for k in ("fp32", "bf16", "int8", "fp8_e4m3")), f"{sizes['int8'] / sizes['bf16']:.3f}",
                      f"{sizes['int8'] / sizes['fp32']:.3f}", f"{record:,}", *(f"{d:.1e}" for d in diffs))
    console.print(table)


if __name__ == "__main__":
    main()
