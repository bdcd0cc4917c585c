"""`smd eval`: the base model or a checkpoint on a task's test split, scored by the task's own metric.

Greedy by default (`eval.temperature=0`) or sampled from a generator seeded by `seed`; dense by default
(`eviction=none`) or with an evicting KV cache (`eviction=snapkv compression=0.5`), which is how a
policy trained with SMD is deployed. `checkpoint` is a `save_pretrained` directory (a train run's
`checkpoints/step_N/model` or `final/`, or a folder holding `model/`); without one the base model is
used (the tiny model warm-started as in `smd train`). Writes `predictions.jsonl` (one row per example:
completion, reference, metrics, lengths) and `summary.json` (the primary metric as `metric` with
`metric_stderr`, every task metric, KV bytes, peak memory, tokens/s); the library half is
`smd_cli.evaluation.evaluate`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from smd_cli import distributed, integrity, models
from smd_cli.evaluation import evaluate
from smd_cli.eviction.none import KeepAll
from smd_cli.io import write_json, write_jsonl
from smd_cli.stages.common import (ConfigError, build_policy, build_task, check, check_top_k, compute_dtype, console, load_examples,
                                  load_model, print_metrics, start_run)


def validate(cfg: DictConfig) -> None:
    e = cfg.eval
    check(e.limit is None or (isinstance(e.limit, int) and e.limit >= 1), "eval.limit", e.limit, "null (the whole split) or an integer >= 1")
    check(isinstance(e.batch_size, int) and e.batch_size >= 1, "eval.batch_size", e.batch_size, "an integer >= 1")
    check(isinstance(e.temperature, (int, float)) and e.temperature >= 0, "eval.temperature", e.temperature, ">= 0 (0 = greedy)")
    check(0 < e.top_p <= 1, "eval.top_p", e.top_p, "in (0, 1]")
    check_top_k(e.top_k, "eval.top_k")
    check(isinstance(e.max_new_tokens, int) and e.max_new_tokens >= 1, "eval.max_new_tokens", e.max_new_tokens, "an integer >= 1")
    if cfg.checkpoint is not None:
        checkpoint_dir(cfg.checkpoint)


def checkpoint_dir(path) -> Path:
    """The `save_pretrained` directory named by `checkpoint`: the path itself or its `model/` folder."""
    root = Path(str(path))
    check(root.is_dir(), "checkpoint", str(path), "an existing directory (a train run's checkpoints/step_N/model or final/)")
    for candidate in (root, root / "model"):
        if (candidate / "config.json").is_file():
            if not any(candidate.glob("*.safetensors")):
                raise ConfigError(f"checkpoint={str(path)!r}: {candidate} has config.json but no *.safetensors weights")
            verify_written(path, candidate)
            return candidate
    raise ConfigError(f"checkpoint={str(path)!r} is not a save_pretrained directory: no config.json in it or in its model/")


def verify_written(path, weights: Path) -> None:
    """A checkpoint `smd train` wrote carries a manifest (in `final/`, or in `step_N/` above `model/`): the
    files must still match it. A directory from elsewhere (a Hub download) has none and is read as it is."""
    for folder in (weights, weights.parent):
        if (folder / integrity.MANIFEST).is_file():
            problems = integrity.verify(folder)
            if problems:
                raise ConfigError(f"checkpoint={str(path)!r} is corrupt: {'; '.join(problems[:3])}. Evaluate another "
                                  "checkpoint of the run (its checkpoints/step_N/) instead")
            return


def load_checkpoint(cfg: DictConfig, device: torch.device):
    """(model, tokenizer) from `cfg.checkpoint`. The tokenizer is model.tokenizer if set; at the tiny scale
    (model.name_or_path null) the project's own, rebuilt; else the checkpoint's own copy, or model.name_or_path's."""
    m, path = cfg.model, checkpoint_dir(cfg.checkpoint)
    own = path if (path / "tokenizer_config.json").is_file() else None
    source = m.tokenizer or (None if m.name_or_path is None else own or m.name_or_path)
    tokenizer = models.build_tiny_tokenizer() if source is None else models.load_hub_tokenizer(str(source), m.trust_remote_code)
    model = models.load_hub_model(str(path), compute_dtype(cfg, device), m.trust_remote_code, random_init=False)
    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(f"checkpoint={str(cfg.checkpoint)!r}: vocabulary {model.config.vocab_size} is smaller than the "
                          f"tokenizer's {len(tokenizer)} ids; set model=... (or model.tokenizer=...) to the one it was trained with")
    return model.to(device).eval(), tokenizer


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    run_ = start_run(cfg)
    task = build_task(cfg)
    policy = build_policy(cfg)
    policy = None if isinstance(policy, KeepAll) else policy  # dense: the plain cache, and its KV bytes are measured
    split = cfg.split or task.test_split
    examples = load_examples(task, split, cfg.eval.limit)
    if cfg.checkpoint is None:
        model, tokenizer = load_model(cfg, task, run_.device, progress=cfg.progress)
    else:
        model, tokenizer = load_checkpoint(cfg, run_.device)
    e = cfg.eval
    console.print(f"eval: {task.name}/{split}, {len(examples)} examples, model={cfg.model.name} checkpoint={cfg.checkpoint}, "
                  f"eviction={'none' if policy is None else repr(policy)}, temperature={e.temperature}")
    rows, summary = evaluate(model, tokenizer, task, examples, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                             policy=policy, temperature=float(e.temperature), top_p=float(e.top_p), top_k=e.top_k, seed=cfg.seed,
                             progress=cfg.progress)
    name = task.primary_metric.name if hasattr(task, "primary_metric") else "reward"
    summary.update({"metric_name": name, "metric": summary[name], "metric_stderr": summary[f"{name}_stderr"],
                    "task": task.name, "split": split, "model": cfg.model.name, "checkpoint": cfg.checkpoint,
                    "eviction": "none" if policy is None else type(policy).__name__,
                    "compression": None if policy is None else float(cfg.compression), "temperature": float(e.temperature)})
    if distributed.is_main():  # under torchrun every rank evaluated a share; rank 0 holds all the rows and writes
        write_jsonl(run_.dir / "predictions.jsonl", rows)
        write_json(run_.dir / "summary.json", summary)
        print_summary(summary, run_.dir)
    distributed.barrier()
    return summary


def print_summary(summary: dict, run_dir) -> None:
    name = summary["metric_name"]
    rows = [(name, f"{summary['metric']:.4f} ± {summary['metric_stderr']:.4f}")]
    rows += [(k, f"{v:.4f} ± {summary[f'{k}_stderr']:.4f}") for k, v in summary.items()  # the task's other metrics
             if f"{k}_stderr" in summary and k not in (name, "metric", "reward")]
    print_metrics(f"smd eval: {summary['task']}/{summary['split']} -> {run_dir}", summary,
                  ("n", "response_tokens_mean", "finished_fraction", "kv/bytes_peak", "kv/bytes_peak_dense",
                   "memory/peak_allocated_bytes", "memory/peak_rss_bytes", "tokens_per_second", "seconds"), tuple(rows))
    console.print(f"eviction={summary['eviction']} compression={summary['compression']} temperature={summary['temperature']}")
