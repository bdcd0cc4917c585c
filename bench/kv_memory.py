"""KV memory at rollout, per eviction policy, and the learners' memory, measured side by side in one run.

    .venv/bin/python bench/kv_memory.py                      # tiny scale, CPU, every conf/eviction/*.yaml
    .venv/bin/python bench/kv_memory.py --prompt 512 --new 64 --rows 8 --compression 0.7

Part 1 (DESIGN.md contract 4): for each policy, the rollout's peak KV bytes (storage nbytes of the cache's
key/value tensors, observed after every forward) next to a dense DynamicCache over the same tokens, their
ratio, and the kept fraction (entries held at the peak / entries a dense cache holds); plus the parity of
the shadow and physical learners with the sampler.
Part 2 (contract 3): peak memory of one forward + backward of the dense, shadow and physical learners on
the same batch. On CUDA: `torch.cuda.max_memory_allocated` above the starting point. On CPU: the peak of
live bytes allocated by torch ops during the call, from the profiler's memory events (every op's self
allocation minus frees, in start order); transient allocations inside one kernel are not seen.
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

from smd_cli.models import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from smd_cli.physical import physical_response_logits  # noqa: E402
from smd_cli.rollout import generate  # noqa: E402
from smd_cli.losses import token_logprobs  # noqa: E402
from smd_cli.scoring import response_logits  # noqa: E402


def peak_bytes(fn) -> int:
    """Peak bytes allocated while `fn()` runs, above what was live before (see the module docstring)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def policies(compression: float, seed: int):
    for path in sorted((ROOT / "conf" / "eviction").glob("*.yaml")):
        cfg = OmegaConf.merge({"compression": compression, "seed": seed}, {"policy": OmegaConf.load(path)})
        yield path.stem, instantiate(cfg.policy)


def learner_step(model, learner, batch):
    def step():
        model.zero_grad(set_to_none=True)
        evict_at = () if learner is response_logits and batch.evict_at is None else (batch.evict_at,)
        logits = learner(model, batch.input_ids, batch.attention_mask, batch.prompt_length, *evict_at)
        logp = token_logprobs(logits, batch.input_ids[:, batch.prompt_length:])
        logp[batch.response_mask].sum().backward()

    return step


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
    batches = {}
    for name, policy in policies(args.compression, args.seed):
        batch = generate(model, prompts, policy=policy, max_new_tokens=args.new, generator=torch.Generator().manual_seed(args.seed),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        batches[name] = batch
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

    where = "torch.cuda.max_memory_allocated" if device == "cuda" else "CPU profiler memory events"
    memory = Table(title=f"Learner peak memory, forward + backward ({where})")
    for column in ("policy", "dense", "shadow (SMD)", "physical", "shadow / dense", "physical / dense"):
        memory.add_column(column, justify="right")
    for name in ("snapkv", "h2o"):
        batch = batches[name]
        peaks = [
            peak_bytes(learner_step(model, response_logits, _dense(batch))),
            peak_bytes(learner_step(model, response_logits, batch)),
            peak_bytes(learner_step(model, physical_response_logits, batch)),
        ]
        memory.add_row(name, *(f"{p:,.0f}" for p in peaks), f"{peaks[1] / peaks[0]:.3f}", f"{peaks[2] / peaks[0]:.3f}")
    console.print(memory)


def _dense(batch):
    from dataclasses import replace

    return replace(batch, evict_at=None)


if __name__ == "__main__":
    main()
