"""TRL's GRPOTrainer against `smd train` on the same work, side by side in one run (issue 11, item 1).

Usage: python bench/peer_trl.py [--rounds 3] [--steps 6] [--prompt-tokens 256] [--out results/bench/peer_trl.json]
Needs TRL, an optional extra for benchmarks only: `pip install -e ".[bench]"` (`make bench` does it).

The work, identical on both sides:
- the tiny Qwen3 (2 layers, hidden 64, intermediate 192, GQA 4/2, head dim 16) built by
  `smd_cli.model.build.build_tiny_model(seed=0)` and the project's tokenizer, saved with `save_pretrained` to a
  temporary folder that TRL loads (float32, SDPA); `smd train` builds the very same weights from the same seed;
- prompts: the needle task's train prompts 0, 1, 2, ... in order (TRL: `shuffle_dataset=False`), BOS + 255
  words = 256 tokens each (TRL receives the text with the BOS written out, which tokenizes to the same ids);
- 2 prompts x 8 generations per step, 8 new tokens (eos stops a sample early on both sides), temperature 1,
  top-p 1, no top-k;
- reward: the fraction of the completion's characters that are digits, computed from the decoded text (special
  tokens skipped) by `digit_fraction` on both sides (smd: a needle task with this reward, `task._target_`);
- GRPO: group-normalised advantages (std + 1e-4), clip 0.2, token-mean loss (TRL `loss_type="dapo"`), beta 0
  (no reference model), one iteration (pi_old = the detached log-probs of the one forward, on both sides);
- AdamW (fused, lr 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay), constant learning rate, gradient
  clipping at 1.0; float32 everywhere, no gradient checkpointing (TRL turns on bf16 and gradient
  checkpointing by default: both are turned off here), one thread per process, no warm start, no eval;
- the LM head scores the 8 completion positions only: TRL does so on CUDA/XPU (Triton), but on a CPU its fused
  head scores all 16 x 263 positions through the vocabulary, forward and backward (about 33x the head's work,
  about half of its CPU step here); `compact_lm_head` sends TRL down its GPU branch (`--trl-full-head`: stock).

Each run is a fresh subprocess: TRL through a `TrainerCallback` (`on_step_begin` -> `on_step_end`: generation,
reward, loss, backward, clipping, optimizer step), smd through its real entry point `python -m smd_cli.cli
train ...` with its per-step `step_time` read back from `metrics.jsonl` (rollout with reward, learner step). A
round runs TRL dense, smd dense, smd naive_sparse and smd smd (both SnapKV, c = 0.5: context, not the same
work), in an order reversed every other round so that drift in the machine's load hits all alike. Each run's
first step (warm-up) is discarded; medians are over the remaining steps of all rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # `python bench/peer_trl.py` from a checkout without the editable install
    sys.path.insert(0, str(ROOT))

from smd_cli.runtime.integrity import write_file  # noqa: E402
from smd_cli.tasks.synthetic import NeedleRetrieval  # noqa: E402

PROMPTS_PER_STEP, GENERATIONS, NEW_TOKENS, LR, SEED = 2, 8, 8, 1e-3, 0
EVICTING = ["eviction=snapkv", "compression=0.5"]
SMD_ALGOS = {"dense": ["algo=dense"], "naive_sparse": ["algo=naive_sparse", *EVICTING], "smd": ["algo=smd", *EVICTING]}
RUNS = ["trl dense", "smd dense", "smd naive_sparse", "smd smd"]


def digit_fraction(text: str) -> float:
    """The trivial reward of both sides: the fraction of the completion's characters that are digits."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class DigitNeedle(NeedleRetrieval):
    """The needle task's prompts (same name, so the same prompts) with `digit_fraction` as the reward;
    `smd train task._target_=peer_trl.DigitNeedle` (bench/ on PYTHONPATH)."""

    def reward(self, completion: str, example: dict) -> float:
        return digit_fraction(completion)


def worker_vars() -> dict:
    """What each run's process gets on top of this one's environment (run from the repository root)."""
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def save_model(folder: Path) -> None:
    """The tiny model smd builds at seed 0 and its tokenizer, in `save_pretrained` format, for TRL."""
    import torch

    from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), seed=SEED, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"  # smd's own attention is registered only inside smd
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def smd_command(algo: str, steps: int, prompt_tokens: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "smd_cli.cli", "train", f"hydra.run.dir={run_dir}", f"steps={steps}", f"seed={SEED}",
            "device=cpu", "threads=1", "progress=false", "model.warmstart.steps=0", "eval.num_prompts=0",
            "task=needle", "task._target_=peer_trl.DigitNeedle", f"task.prompt_tokens={prompt_tokens - 1}",
            f"grpo.prompts_per_step={PROMPTS_PER_STEP}", f"grpo.num_generations={GENERATIONS}", "grpo.beta=0.0",
            f"sampling.max_new_tokens={NEW_TOKENS}", "sampling.temperature=1.0", "sampling.top_p=1.0", f"optim.lr={LR}",
            "checkpoint.every=0", "checkpoint.keep_last=1", "guard.collapse_steps=0", *SMD_ALGOS[algo]]


def trl_command(steps: int, prompt_tokens: int, model_dir: Path, out: Path, full_head: bool) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--steps", str(steps), "--prompt-tokens", str(prompt_tokens),
            "--model-dir", str(model_dir), "--worker-out", str(out), *(["--trl-full-head"] if full_head else [])]


def compact_lm_head(compact: bool) -> str:
    """TRL's fused LM head scores only the completion positions on Triton devices (CUDA, XPU) but every position of
    the batch elsewhere (a fixed shape for compilers): on this CPU 16 x 263 positions instead of 16 x 8, through the
    vocabulary, forward and backward. smd scores the completion positions only; `compact` gives TRL the same work by
    making that one decision (`trl.trainer.utils._use_triton`, read only there) take the Triton-device branch."""
    import trl.trainer.utils as trl_utils

    if not compact:
        return "stock (every position on a CPU)"
    if not hasattr(trl_utils, "_use_triton"):
        return "stock (no _use_triton in this TRL)"
    trl_utils._use_triton = lambda device: True
    return "completion positions only (as on a GPU)"


def trl_worker(args) -> None:
    """One TRL run in this process: per-step times (and the generation part of each) to `--worker-out`."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    head = compact_lm_head(not args.trl_full_head)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    task = DigitNeedle(prompt_tokens=args.prompt_tokens - 1)
    rows = [task.example(task.train_split, i) for i in range(args.steps * PROMPTS_PER_STEP)]
    data = Dataset.from_list([{"prompt": tok.bos_token + e["prompt"]} for e in rows])
    first = tok(data[0]["prompt"])["input_ids"]
    assert len(first) == args.prompt_tokens and first == task.encode_prompt(rows[0], tok), "TRL's prompt ids differ from smd's"

    def reward(completions, **_) -> list[float]:
        return [digit_fraction(c) for c in completions]

    # TRL defaults to gradient checkpointing (and bf16): off, as in smd train. transformers >= 5.? renamed it.
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    no_checkpointing = {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": False}
    config = GRPOConfig(
        output_dir=str(Path(args.worker_out).parent / "trl_out"), max_steps=args.steps, seed=SEED,
        per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS, gradient_accumulation_steps=1,
        num_generations=GENERATIONS, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        use_cpu=True, bf16=False, fp16=False, shuffle_dataset=False, **no_checkpointing,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        logging_steps=10**6, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
    )
    times, gen = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[StepTimer()])
    generate_and_score = trainer._generate_and_score_completions

    def timed(*a, **k):  # the rollout part of the step (tokenize, generate, reward, advantages)
        t0 = time.perf_counter()
        out = generate_and_score(*a, **k)
        gen.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed
    torch.set_num_threads(1)
    trainer.train()
    model, optimizer = trainer.model, getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    checkpointing = model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") else model.is_gradient_checkpointing
    checks = {
        "lm_head": head, "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype), "bf16": config.bf16,
        "checkpointing": bool(checkpointing),
        "attention": model.config._attn_implementation, "optimizer": type(optimizer).__name__,
        "fused": optimizer.defaults.get("fused"), "lr_last": trainer.lr_scheduler.get_last_lr()[0],
        # TRL's extra no-grad pi_old forward, which smd does not do either; off with one iteration, no accumulation
        "old_logps_forward": config.gradient_accumulation_steps % (config.steps_per_generation * config.num_iterations) != 0,
    }
    assert checks["dtype"] == "torch.float32" and not checks["bf16"] and not checks["checkpointing"], checks
    write_file(Path(args.worker_out), json.dumps({"step_time": times, "rollout_s": gen, "checks": checks}))


def run_one(name: str, args, tmp: Path, model_dir: Path, tag: str) -> tuple[dict, list[str]]:
    """Run `name` once; its per-step times (and rollout parts), and the command."""
    side, algo = name.split()
    if side == "trl":
        out = tmp / f"trl_{tag}.json"
        cmd = trl_command(args.steps, args.prompt_tokens, model_dir, out, args.trl_full_head)
    else:
        run_dir = tmp / f"smd_{algo}_{tag}"
        cmd = smd_command(algo, args.steps, args.prompt_tokens, run_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **worker_vars()}, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{name} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    if side == "trl":
        got = json.loads(out.read_text())
        times, rollout, checks = got["step_time"], got["rollout_s"], got["checks"]
    else:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        times, rollout = [r["step_time"] for r in rows], [r["time/rollout_s"] for r in rows]
        checks = {"kv/kept_fraction": rows[-1].get("kv/kept_fraction"), "completions/mean_length": rows[-1].get("completions/mean_length")}
    if len(times) != args.steps:
        sys.exit(f"{name}: {len(times)} step times for {args.steps} steps")
    return {"step_time": times, "rollout_s": rollout, "wall_s": wall, "checks": checks}, cmd


def git_state() -> dict:
    def git(*args):
        proc = subprocess.run(["git", "-C", str(ROOT), *args], check=False, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def versions() -> dict:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for pkg in ("trl", "accelerate"):
        try:
            out[pkg] = __import__(pkg).__version__
        except ImportError:
            out[pkg] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (TRL, smd dense, smd naive_sparse, smd smd)")
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is discarded as warm-up)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens, BOS included")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "peer_trl.json")
    ap.add_argument("--trl-full-head", action="store_true",
                    help="leave TRL's LM head as it is on a CPU: every position scored (more work than smd's step)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step of each run is discarded)")
    ver = versions()
    if ver["trl"] is None:
        sys.exit('TRL is not installed: pip install -e ".[bench]" (or make bench)')

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as folder:
        tmp = Path(folder)
        model_dir = tmp / "model"
        save_model(model_dir)
        runs = {name: [] for name in RUNS}
        commands = {}
        for r in range(args.rounds):
            for name in RUNS if r % 2 == 0 else RUNS[::-1]:
                got, cmd = run_one(name, args, tmp, model_dir, f"r{r}")
                runs[name].append(got)
                commands[name] = shlex.join(cmd).replace(folder, "$TMP")
                kept = got["step_time"][1:]
                print(f"round {r + 1}/{args.rounds} {name:<17} median step {statistics.median(kept):.3f} s "
                      f"(steps {', '.join(f'{t:.3f}' for t in got['step_time'])}; process {got['wall_s']:.1f} s)", flush=True)

    for name in RUNS:  # the rest of each step: loss, backward, clipping, optimizer step
        for run in runs[name]:
            run["learner_s"] = [t - g for t, g in zip(run["step_time"], run["rollout_s"])]

    def med(name: str, key: str) -> float:
        return statistics.median(t for run in runs[name] for t in run[key][1:])

    trl = med("trl dense", "step_time")
    # paired: each round's median against the same round's TRL median
    per_round = {name: [statistics.median(runs[name][r]["step_time"][1:]) / statistics.median(runs["trl dense"][r]["step_time"][1:])
                        for r in range(args.rounds)] for name in RUNS}
    summary = {name: {"median_step_s": med(name, "step_time"), "median_rollout_s": med(name, "rollout_s"),
                      "median_learner_s": med(name, "learner_s"),
                      "ratio_to_trl": med(name, "step_time") / trl, "ratio_to_trl_per_round": per_round[name]} for name in RUNS}

    print(f"\nGRPO step: {PROMPTS_PER_STEP} prompts x {GENERATIONS} generations, prompt {args.prompt_tokens} tokens, "
          f"{NEW_TOKENS} new tokens, tiny Qwen3, 1 thread; {args.rounds} rounds x {args.steps} steps (first of each run dropped)")
    print(f"torch {ver['torch']}, transformers {ver['transformers']}, trl {ver['trl']}, accelerate {ver['accelerate']}; "
          f"TRL's LM head: {runs['trl dense'][0]['checks']['lm_head']}\n")
    print("| run | median step | rollout | learner | step / TRL step | per round |")
    print("|---|---:|---:|---:|---:|---|")
    for name in RUNS:
        s = summary[name]
        print(f"| {name} | {s['median_step_s']:.3f} s | {s['median_rollout_s']:.3f} s | {s['median_learner_s']:.3f} s | "
              f"{s['ratio_to_trl']:.3f} | {', '.join(f'{x:.2f}' for x in s['ratio_to_trl_per_round'])} |")
    print("\n(rollout: TRL's _generate_and_score_completions, smd's time/rollout_s; learner: the rest of the step. "
          "smd naive_sparse and smd evict at the rollout (SnapKV, c = 0.5): context, not the same work.)")

    report = {
        "setup": {"prompts_per_step": PROMPTS_PER_STEP, "num_generations": GENERATIONS, "prompt_tokens": args.prompt_tokens,
                  "max_new_tokens": NEW_TOKENS, "lr": LR, "seed": SEED, "rounds": args.rounds, "steps": args.steps,
                  "threads": 1, "discarded_first_steps": 1, "trl_lm_head": runs["trl dense"][0]["checks"]["lm_head"], "reward": "digit_fraction of the decoded completion",
                  "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}},
        "versions": ver,
        "git": git_state(),
        "commands": {**commands, "bench": shlex.join([sys.executable, *sys.argv])},
        "command_env": {"cwd": str(ROOT), **worker_vars()},  # bench/ on PYTHONPATH: smd's task._target_=peer_trl.DigitNeedle
        "times": runs,
        "summary": summary,
        "seconds": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_file(args.out, json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
