"""TRL + SMD against plain TRL: GRPO step time, side by side in one process (issue 44, evidence 3).

Usage: python bench/trl_smd.py [--rounds 2] [--steps 4] [--model smollm2|tiny] [--out results/bench/trl_smd.json]

The work, the same on both sides: SmolLM2-135M-Instruct (float32, one thread) on passkey prompts at `smd train scale=small`'s
settings (~227-token prompts, 2 prompts x 4 generations a step, 12 new tokens, temperature 1), dapo loss, beta 0, one
iteration, AdamW at lr 1e-5, clipping at 1.0, no gradient checkpointing, no bf16.
- plain TRL: `GRPOTrainer` as a TRL user runs it, on the model loaded with transformers' SDPA attention from the same
  weights (the dequantised GGUF smd caches): transformers' `generate` with a dense cache, TRL's learner forward.
- TRL + SMD: `SMDGRPOTrainer` (smd_cli/integrations/trl.py) with SnapKV at c = 0.5 and lambda 0.1, on the model as smd's
  `load_model` gives it (its row floor and float64 attention: the settings under which the replay's parity is exact on
  this model; README "Parity on a real model"): the evicting sampler, the replay and the dense teacher.
TRL's fused LM head scores only the completion positions, as on a GPU (`bench/peer_trl.py`'s `compact_lm_head`: on a CPU
it would score every position through the vocabulary; `--trl-full-head` leaves it stock).
Each run is a fresh trainer on a fresh copy of its model; a round runs both, in an order reversed every other round;
the first step of each run is dropped (warm-up); the ratio is TRL + SMD's median step over plain TRL's, overall and
per round. Step: `on_step_begin` -> `on_step_end` (generation, reward, loss, backward, clipping, optimizer step); its
rollout part is TRL's `_generate_and_score_completions` (tokenize, generate, reward, advantages), the rest the learner.
Both sides are TRL; the difference is the engine's: SMD's sampler and learner compute each prompt once for its G samples
(`smd_cli.learner.forward.shared_prompt_views`), where `generate` prefills, and TRL's learner runs, every copy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for path in (str(ROOT), str(BENCH), str(ROOT / "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
from peer_trl import compact_lm_head  # noqa: E402
from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_smd import SCALES, grpo_config, load, train_data  # noqa: E402  (examples/trl_smd.py)

from smd_cli.integrations.trl import SMDConfig, SMDGRPOTrainer  # noqa: E402
from smd_cli.runtime.integrity import write_file  # noqa: E402

ARMS = ["plain TRL", "TRL + SMD"]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_begin(self, *_, **__):
        self.t0 = time.perf_counter()

    def on_step_end(self, *_, **__):
        self.times.append(time.perf_counter() - self.t0)


def run(arm: str, models: dict, cfg, task, tokenizer, args) -> dict[str, list[float]]:
    """One fresh trainer of `arm` for `args.steps` steps: its step times and their rollout part (TRL's
    `_generate_and_score_completions`: tokenize, generate, reward, advantages); the rest is the learner."""
    model = copy.deepcopy(models[arm])
    per_step = SCALES[args.model]["prompts_per_step"]

    def reward(completions, index, **_) -> list[float]:
        return [task.reward(c, task.example(task.train_split, i)) for c, i in zip(completions, index)]

    common = dict(model=model, reward_funcs=reward, args=grpo_config(cfg, args.model, args.steps, SCALES[args.model]["lr"], "/tmp/trl_smd_bench"),
                  train_dataset=train_data(task, tokenizer, args.steps * per_step), processing_class=tokenizer)
    if arm == "plain TRL":
        trainer = GRPOTrainer(**common)
    else:
        trainer = SMDGRPOTrainer(**common, smd=SMDConfig(policy="snapkv", compression=0.5, lam=cfg["lambda"]))
    trainer.remove_callback(PrinterCallback)
    timer, rollout = StepTimer(), []
    trainer.add_callback(timer)
    generate_and_score = trainer._generate_and_score_completions

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = generate_and_score(*a, **k)
        rollout.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    assert len(timer.times) == len(rollout) == args.steps, (arm, timer.times, rollout)
    return {"step": timer.times, "rollout": rollout, "learner": [t - r for t, r in zip(timer.times, rollout)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    ap.add_argument("--model", choices=sorted(SCALES), default="smollm2")
    ap.add_argument("--trl-full-head", action="store_true", help="leave TRL's LM head stock (every position scored on a CPU)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "trl_smd.json")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step of each run is dropped)")
    torch.set_num_threads(1)
    started = time.perf_counter()
    head = compact_lm_head(not args.trl_full_head)
    cfg, task, smd_model, tokenizer = load(args.model, 0)
    plain = smd_model
    if args.model == "smollm2":  # plain TRL: the same weights through transformers' own loading and SDPA attention
        from smd_cli.runs.model_loading import model_source

        plain = AutoModelForCausalLM.from_pretrained(model_source(cfg)[0], dtype=torch.float32, attn_implementation="sdpa").eval()
    models = {"plain TRL": plain, "TRL + SMD": smd_model}
    times = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            got = run(arm, models, cfg, task, tokenizer, args)
            times[arm].append(got)
            print(f"round {r + 1}/{args.rounds} {arm:<10} steps {', '.join(f'{t:.2f}' for t in got['step'])} s "
                  f"(rollout {', '.join(f'{t:.2f}' for t in got['rollout'])})", flush=True)

    def median(arm: str, part: str) -> float:
        return statistics.median(t for run_ in times[arm] for t in run_[part][1:])

    med = {arm: {part: median(arm, part) for part in ("step", "rollout", "learner")} for arm in ARMS}
    per_round = [statistics.median(times["TRL + SMD"][r]["step"][1:]) / statistics.median(times["plain TRL"][r]["step"][1:])
                 for r in range(args.rounds)]
    ratio = med["TRL + SMD"]["step"] / med["plain TRL"]["step"]
    print(f"\n{args.model}, torch threads {torch.get_num_threads()}, TRL's LM head: {head}; {args.rounds} rounds x {args.steps} steps, first of each run dropped")
    print("| arm | median step | rollout | learner |\n|---|---:|---:|---:|")
    for arm in ARMS:
        print(f"| {arm} | {med[arm]['step']:.2f} s | {med[arm]['rollout']:.2f} s | {med[arm]['learner']:.2f} s |")
    print(f"TRL + SMD / plain TRL, step: {ratio:.2f} (per round {', '.join(f'{x:.2f}' for x in per_round)}); rollout "
          f"{med['TRL + SMD']['rollout'] / med['plain TRL']['rollout']:.2f}, learner {med['TRL + SMD']['learner'] / med['plain TRL']['learner']:.2f}")
    import transformers
    import trl

    report = {"model": args.model, "rounds": args.rounds, "steps": args.steps, "lm_head": head, "times": times, "median_s": med,
              "ratio": ratio, "ratio_per_round": per_round, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 1},
              "seconds": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_file(args.out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
