"""`smd train`: GRPO on a task, with any of the algorithms of DESIGN.md section 4.

Each step samples `grpo.prompts_per_step` prompts x G generations with the rollout's eviction policy
(none for algo=dense), scores them with the task's reward, normalises advantages within each group,
and takes one `learner_step`. Held-out reward is measured before and after training on the task's test split
(sampled at the eval temperature, seeded, and greedy). Sampling at step s uses a generator seeded from (seed, s), so a resumed run
draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import copy
import time

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from smd_cli.evaluation import evaluate
from smd_cli.eviction.none import KeepAll
from smd_cli.io import MetricsLog, write_json
from smd_cli.learner import ALGORITHMS, Algorithm, learner_step
from smd_cli.losses import group_advantages
from smd_cli.rollout import generate
from smd_cli.stages.common import ConfigError, build_policy, build_task, check, console, load_model, start_run


def validate(cfg: DictConfig) -> None:
    g, s = cfg.grpo, cfg.sampling
    check(cfg.algo.name in ALGORITHMS, "algo", cfg.algo.name, f"one of {', '.join(ALGORITHMS)}")
    check(isinstance(cfg.steps, int) and cfg.steps >= 0, "steps", cfg.steps, "an integer >= 0")
    check(isinstance(g.num_generations, int) and g.num_generations >= 2, "grpo.num_generations", g.num_generations,
          "an integer >= 2 (GRPO normalises each reward against the other samples of its group)")
    check(isinstance(g.prompts_per_step, int) and g.prompts_per_step >= 1, "grpo.prompts_per_step", g.prompts_per_step, "an integer >= 1")
    check(0 < g.epsilon < 1, "grpo.epsilon", g.epsilon, "a clip range in (0, 1)")
    check(g.epsilon_high is None or g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high, "null (= epsilon) or > 0")
    check(g.beta >= 0, "grpo.beta", g.beta, ">= 0")
    check(g.loss_agg in ("token_mean", "seq_mean_token_mean"), "grpo.loss_agg", g.loss_agg, "token_mean or seq_mean_token_mean")
    check(g.scale_rewards in ("group", "none"), "grpo.scale_rewards", g.scale_rewards, "group or none")
    check(isinstance(g.num_iterations, int) and g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "an integer >= 1")
    check(g.micro_batch_size is None or g.micro_batch_size >= 1, "grpo.micro_batch_size", g.micro_batch_size, "null or >= 1")
    check(g.max_grad_norm > 0, "grpo.max_grad_norm", g.max_grad_norm, "> 0")
    check(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "a learning rate > 0")
    check(s.temperature > 0, "sampling.temperature", s.temperature, "> 0 for GRPO sampling (0 is greedy: no exploration)")
    check(0 < s.top_p <= 1, "sampling.top_p", s.top_p, "in (0, 1]")
    check(isinstance(s.max_new_tokens, int) and s.max_new_tokens >= 1, "sampling.max_new_tokens", s.max_new_tokens, "an integer >= 1")
    check(cfg["lambda"] >= 0, "lambda", cfg["lambda"], ">= 0 (the SMD distillation weight)")
    check(cfg.eval.num_prompts >= 0, "eval.num_prompts", cfg.eval.num_prompts, ">= 0")


def rollout_policy(cfg: DictConfig):
    """The rollout's eviction policy; None (a plain dense rollout) for algo=dense."""
    policy = build_policy(cfg)
    if not cfg.algo.evicting:
        if not isinstance(policy, KeepAll):
            raise ConfigError(f"algo={cfg.algo.name} samples without eviction, but eviction={type(policy).__name__} was set; "
                              "use algo=naive_sparse, sparse_rl, tis or smd to train with an evicting rollout")
        return None
    if isinstance(policy, KeepAll):
        console.print(f"[yellow]note:[/yellow] algo={cfg.algo.name} with eviction=none keeps every KV entry")
    return policy


def algorithm(cfg: DictConfig) -> Algorithm:
    g, a = cfg.grpo, cfg.algo
    return Algorithm(
        name=a.name, epsilon=g.epsilon, epsilon_high=g.epsilon_high, beta=g.beta, loss_agg=g.loss_agg,
        num_iterations=g.num_iterations, micro_batch_size=g.micro_batch_size, max_grad_norm=g.max_grad_norm,
        temperature=cfg.sampling.temperature, lam=cfg["lambda"],
        sparse_rl=dict(a.get("sparse_rl") or {"cap": 1.5, "low": 0.5, "high": 1.5, "veto": 1e-4}), tis_cap=a.get("tis_cap", 2.0),
    )


def prompts_at(task, step: int, per_step: int, seed: int, pool: list | None) -> list[dict]:
    """The prompts of training step `step` (0-based): a pure function of (step, seed) so runs resume exactly.

    Generated tasks are read in order; loaded datasets are walked in a fresh seeded permutation per epoch."""
    if pool is None:
        return [task.example(task.train_split, step * per_step + i) for i in range(per_step)]
    picked = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(i, len(pool))
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(pool[int(order[offset])])
    return picked


def held_out(model, tokenizer, task, examples, cfg, when: str) -> dict[str, float]:
    """Reward on held-out prompts at the eval temperature (seeded; the policy's expected reward), and
    greedy when `eval.greedy`: `eval/reward_{when}`, `eval/greedy_reward_{when}`."""
    if not examples:
        return {}
    out = {}
    for key, temperature in (("reward", cfg.eval.temperature), ("greedy_reward", 0.0 if cfg.eval.greedy else None)):
        if temperature is None:
            continue
        _, summary = evaluate(model, tokenizer, task, examples, max_new_tokens=cfg.sampling.max_new_tokens,
                              batch_size=cfg.eval.batch_size, temperature=temperature, top_p=cfg.sampling.top_p,
                              seed=cfg.seed + 1, progress=cfg.progress)
        out[f"eval/{key}_{when}"] = summary["reward"]
    return out


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    run_ = start_run(cfg)
    task = build_task(cfg)
    policy = rollout_policy(cfg)
    model, tokenizer = load_model(cfg, task, run_.device, progress=cfg.progress)
    algo = algorithm(cfg)
    optimizer = instantiate(cfg.optim, params=model.parameters())
    ref_model = copy.deepcopy(model).eval() if algo.beta > 0 else None
    pool = None if hasattr(task, "example") else task.examples(task.train_split)
    eval_examples = task.examples(task.test_split, limit=cfg.eval.num_prompts)
    G, per_step = cfg.grpo.num_generations, cfg.grpo.prompts_per_step

    summary = held_out(model, tokenizer, task, eval_examples, cfg, "before")
    console.print(f"held-out reward before GRPO: {summary.get('eval/reward_before', float('nan')):.4f} "
                  f"({len(eval_examples)} prompts, temperature {cfg.eval.temperature})")
    log = MetricsLog(run_.dir)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    last: dict[str, float] = {}
    started = time.perf_counter()
    with Progress(*columns, console=console, disable=not cfg.progress) as bar:
        job = bar.add_task(f"{algo.name}: rollout", total=cfg.steps)
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            bar.update(job, description=f"{algo.name}: rollout")
            examples = prompts_at(task, step, per_step, cfg.seed, pool)
            prompts = [task.encode_prompt(e, tokenizer) for e in examples for _ in range(G)]
            batch = generate(model, prompts, policy=policy, max_new_tokens=cfg.sampling.max_new_tokens,
                             temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                             generator=torch.Generator(device=run_.device).manual_seed(cfg.seed * 1_000_003 + step),
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False)
            rewards = torch.tensor(rollout_rewards(batch, tokenizer, task, [e for e in examples for _ in range(G)]))
            t1 = time.perf_counter()
            bar.update(job, description=f"{algo.name}: learn  ")
            advantages = group_advantages(rewards, G, cfg.grpo.scale_rewards).to(run_.device)
            metrics = learner_step(model, optimizer, batch, advantages, algo, ref_model)
            t2 = time.perf_counter()
            grouped = rewards.view(-1, G)
            lengths = batch.response_mask.sum(1).float()
            metrics.update({
                "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
                "frac_reward_zero_std": float((grouped.std(1) == 0).float().mean()),
                "completions/mean_length": float(lengths.mean()),
                "completions/clipped_ratio": float((~ended_with_eos(batch, tokenizer.eos_token_id)).float().mean()),
                "time/rollout_s": t1 - t0, "time/learner_s": t2 - t1, "step_time": t2 - t0,
                **{k: v for k, v in batch.stats.items() if k.startswith("kv/")},
            })
            log.log(step + 1, metrics)
            last = metrics
            bar.update(job, advance=1, description=f"{algo.name}: reward {metrics['reward']:.3f}")
    log.close()
    summary["train/seconds"] = time.perf_counter() - started
    summary.update(held_out(model, tokenizer, task, eval_examples, cfg, "after"))
    summary.update({f"last/{k}": v for k, v in last.items()})
    summary["steps"] = cfg.steps
    write_json(run_.dir / "summary.json", summary)
    print_summary(summary, run_.dir)
    return summary


def rollout_rewards(batch, tokenizer, task, examples) -> list[float]:
    responses = batch.input_ids[:, batch.prompt_length :]
    texts = [tokenizer.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(responses, batch.response_mask)]
    return [float(task.reward(t, e)) for t, e in zip(texts, examples)]


def ended_with_eos(batch, eos_token_id: int) -> torch.Tensor:
    lengths = batch.response_mask.sum(1)
    responses = batch.input_ids[:, batch.prompt_length :]
    last = responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    return (lengths > 0) & (last == eos_token_id)


def print_summary(summary: dict, run_dir) -> None:
    table = Table(title=f"smd train: {run_dir}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("eval/reward_before", "eval/reward_after", "eval/greedy_reward_before", "eval/greedy_reward_after", "last/reward", "last/mismatch/max_abs_diff",
                "last/mismatch/dense_max_abs_diff", "last/kv/kept_fraction", "train/seconds"):
        if key in summary:
            table.add_row(key, f"{summary[key]:.4g}")
    console.print(table)
