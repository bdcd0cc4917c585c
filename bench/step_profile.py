"""Where a small-scale GRPO run spends its time: one `smd train` profiled phase by phase (issue 25 item 4).

Usage: python bench/step_profile.py [--steps 3] [--json out.json] [-- EXTRA OVERRIDES...]
Runs `smd train scale=small steps=STEPS` in this process under cProfile (and a timer on each rollout forward, which
tells the prefill from the decode steps) and prints the wall seconds of each phase: start-up (config, model load and
its integrity hash), the held-out evaluations, the rollouts (prefill, decode steps), the learner (forward of the view
and the teacher, backward, optimizer step), the agreement pass, the weight check and the final save. Per step and in
all. cProfile's own overhead is small here (the time is in torch kernels), but compare runs of this script with each
other, not with an unprofiled run's step_time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from smd_cli.runtime.integrity import write_file

PHASES = [  # (label, file suffix, function name): cumulative seconds from the profile
    ("whole run (smd train)", "smd_cli/stages/train.py", "run"),
    ("model load", "smd_cli/runs/model_loading.py", "load_model"),
    ("weights' integrity hash (files read at start)", "smd_cli/runtime/integrity.py", "sha256"),
    ("held-out evaluations (before + after)", "smd_cli/evaluation/batch.py", "evaluate"),
    ("learner step", "smd_cli/learner/step.py", "learner_step"),
    ("  forward: view (+ teacher)", "smd_cli/learner/step.py", "scored"),
    ("  backward", "torch/_tensor.py", "backward"),
    ("  optimizer step", "torch/optim/optimizer.py", "wrapper"),
    ("agreement pass (non-SMD)", "smd_cli/stages/train.py", "measured_agreement"),
    ("weights check", "smd_cli/runs/train_state.py", "check_weights"),
    ("final save", "smd_cli/runtime/checkpoint.py", "save_final"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="more `smd train` overrides (after --)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from smd_cli.cli import main as smd
    from smd_cli.evaluation import batch as evaluation
    from smd_cli.rollout import sampler as rollout

    split = {"prefill": 0.0, "decode": 0.0, "generate": 0.0}
    forward, evaluate, generate, evaluating = rollout._Run.forward, evaluation.evaluate, rollout.generate, []

    def rolled(*a, **k):  # the train stage's own rollouts (evaluation keeps the original `generate`)
        started = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            split["generate"] += time.perf_counter() - started

    def timed(self, model, step):
        started = time.perf_counter()
        try:
            return forward(self, model, step)
        finally:
            if not evaluating:  # a training rollout's
                split["prefill" if step == 0 else "decode"] += time.perf_counter() - started

    def flagged(*a, **k):
        evaluating.append(True)
        try:
            return evaluate(*a, **k)
        finally:
            evaluating.pop()

    rollout._Run.forward, evaluation.evaluate, rollout.generate = timed, flagged, rolled  # before the train stage imports them
    with tempfile.TemporaryDirectory() as where:
        command = ["train", "scale=small", f"steps={args.steps}", "progress=false", f"hydra.run.dir={where}/run", *args.overrides]
        profile = cProfile.Profile()
        started = time.perf_counter()
        try:
            profile.runcall(smd, command)
        except SystemExit as done:
            if done.code:
                raise
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in (Path(where) / "run" / "metrics.jsonl").read_text().splitlines()]
    stats = pstats.Stats(profile).stats
    found = {}
    for label, suffix, name in PHASES:
        found[label] = sum(v[3] for (file, _, func), v in stats.items() if file.endswith(suffix) and func == name)
    found["training rollouts (generate)"] = split["generate"]
    found["  of which: prefill (first forward)"] = split["prefill"]
    found["  of which: decode steps"] = split["decode"]
    order = [p[0] for p in PHASES[:4]] + ["training rollouts (generate)", "  of which: prefill (first forward)", "  of which: decode steps"] + [p[0] for p in PHASES[4:]]
    print(f"smd train scale=small steps={args.steps} {' '.join(args.overrides)}: {wall:.1f} s in this process "
          f"(imports before it not counted); {len(rows)} steps logged")
    print(f"{'phase':44s} {'seconds':>9s} {'per step':>9s}")
    for label in order:
        per = found[label] / args.steps if not label.startswith(("whole", "model", "weights'", "held", "final")) else float("nan")
        print(f"{label:44s} {found[label]:9.2f} {per:9.2f}")
    step_times = [r["step_time"] for r in rows]
    print(f"step_time as logged: {', '.join(f'{t:.2f}' for t in step_times)} s")
    if args.json:
        write_file(args.json, json.dumps({"steps": args.steps, "overrides": args.overrides, "wall_s": wall, "phases_s": found,
                                         "step_time_s": step_times}, indent=2) + "\n")


if __name__ == "__main__":
    main()
