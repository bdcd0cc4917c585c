"""`smd eval`: the base model or a checkpoint on a task's test split, scored by the task's own metric.

Greedy by default (`eval.temperature=0`) or sampled from a generator seeded by `seed`; dense by default
(`eviction=none`) or with an evicting KV cache (`eviction=snapkv compression=0.5`), which is how a
policy trained with SMD is deployed. `checkpoint` is a `save_pretrained` directory (a train run's
`checkpoints/step_N/model` or `final/`, or a folder holding `model/`); without one the base model is
used (the tiny model warm-started as in `smd train`). Writes `predictions.jsonl` (one row per example:
completion, reference, metrics, lengths) and `summary.json` (the primary metric as `metric` with
`metric_stderr`, every task metric, KV bytes, peak memory, tokens/s); the library half is
`smd_cli.evaluation.batch.evaluate`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from smd_cli.config.validation import ConfigError, check
from smd_cli.config.factories import build_policy, build_task
from smd_cli.config.prompts import check_prompts, load_examples
from smd_cli.config.rules import check_config
from smd_cli.evaluation.batch import evaluate
from smd_cli.eviction.none import KeepAll
from smd_cli.model import build as models
from smd_cli.model import weights
from smd_cli.report.stats import plus_minus
from smd_cli.runs.console import console, print_metrics
from smd_cli.runs.model_loading import (
    check_precision,
    check_replayable,
    compute_dtype,
    load_model,
    load_tokenizer,
    mark_weights,
    record_weights,
    set_precision,
)
from smd_cli.runs.run_dirs import start_run
from smd_cli.runtime import distributed, integrity
from smd_cli.runtime.records import write_json, write_jsonl

JSON_BYTES = 1 << 20  # a config.json is a few KiB: a larger one is not read


def validate(cfg: DictConfig) -> None:
    check_config(cfg, "eval")
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


def read_small_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, its size checked before it is parsed; a ConfigError saying what is wrong."""
    size = path.stat().st_size
    if size > JSON_BYTES:
        raise ConfigError(f"{what}: {path} holds {size} bytes, more than the {JSON_BYTES} a model's config.json takes; "
                          "it is not one")
    try:
        value = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{what}: {path} is not readable JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: {path} holds {type(value).__name__}, not a JSON object")
    return value


def trained_as(weights: Path) -> dict | None:
    """The `model` settings of the `smd train` run that wrote `weights` (RUN/final, RUN/checkpoints/step_N/model),
    from the run's config.json; None for weights from elsewhere."""
    for run_dir in (weights.parent, weights.parent.parent.parent):
        path = run_dir / "config.json"
        if path.is_file() and path.stat().st_size <= JSON_BYTES:
            try:
                model = json.loads(path.read_bytes()).get("model")
            except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                continue
            if isinstance(model, dict) and isinstance(model.get("name"), str):
                return model
    return None


def model_overrides(cfg: DictConfig) -> list[str]:
    """The command line's `model=...` and `model.KEY=...` overrides."""
    given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else list(cfg.get("overrides") or [])
    return [o for o in given if o.lstrip("+~").partition("=")[0].split(".")[0] == "model"]


def checkpoint_model(cfg: DictConfig, weights: Path) -> str:
    """The name of the model that `weights` is, for the summary. A `model=` choice or `model.*` override on the
    command line must describe the checkpoint: an architecture field that differs from its config.json is a
    ConfigError (the checkpoint's own architecture is what runs), and settings that do not apply to saved weights
    (the warm start, random init) are named in a note."""
    saved = read_small_json(weights / "config.json", f"checkpoint={str(cfg.checkpoint)!r}")
    trained = trained_as(weights)
    chosen = model_overrides(cfg)
    if not chosen:
        return trained["name"] if trained else f"checkpoint ({saved.get('model_type', 'unknown type')})"
    m = cfg.model
    fields = {**dict(m.get("architecture") or {}), **dict(m.config or {})}
    differ = [f"{k} {saved[k]!r}, not {v!r}" for k, v in fields.items() if k in saved and saved[k] != v]
    if differ:
        was = f" (it was trained as model={trained['name']})" if trained else ""
        raise ConfigError(f"{', '.join(chosen)} is not allowed with checkpoint={str(cfg.checkpoint)!r}: the checkpoint's "
                          f"architecture differs ({'; '.join(differ[:4])}){was}. smd eval runs the checkpoint's own "
                          "architecture: leave model out, or name the model it was trained as")
    unused = [o for o in chosen if o.lstrip("+~").startswith(("model.warmstart", "model.random_init", "model.gradient_checkpointing"))]
    if unused:
        console.print(f"note: {', '.join(unused)} does not apply to a checkpoint's saved weights", highlight=False, markup=False)
    return m.name


def checkpoint_tokenizer(cfg: DictConfig, path: Path):
    """model.tokenizer if set; at the tiny scale (model.name_or_path null) the project's own, rebuilt; else the
    checkpoint's own copy, or model.name_or_path's."""
    m = cfg.model
    own = path if (path / "tokenizer_config.json").is_file() else None
    source = m.tokenizer or (None if m.name_or_path is None else own or m.name_or_path)
    return models.build_tiny_tokenizer() if source is None else models.load_hub_tokenizer(str(source), m.trust_remote_code)


def load_checkpoint(cfg: DictConfig, device: torch.device):
    """(model, tokenizer, name) from `cfg.checkpoint`. The tokenizer is model.tokenizer if set; at the tiny scale
    (model.name_or_path null) the project's own, rebuilt; else the checkpoint's own copy, or model.name_or_path's.
    `name` is the model the checkpoint is (`checkpoint_model`). Weights that cannot be read (cut short, not
    safetensors) are a ConfigError naming the file."""
    m, path = cfg.model, checkpoint_dir(cfg.checkpoint)
    check_precision(cfg, device)
    name = checkpoint_model(cfg, path)
    tokenizer = checkpoint_tokenizer(cfg, path)
    try:
        model = models.load_hub_model(str(path), compute_dtype(cfg, device), m.trust_remote_code, random_init=False)
    except Exception as err:  # safetensors, transformers and torch each raise their own type for a damaged file
        signed = any((folder / integrity.MANIFEST).is_file() for folder in (path, path.parent))
        raise ConfigError(f"checkpoint={str(cfg.checkpoint)!r}: its weights in {path} cannot be loaded "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                          + ("" if signed else "; it has no MANIFEST.json (not written by smd train), so nothing could "
                             "check it before loading")) from None
    check_replayable(model, m.get("name"))
    set_precision(cfg, model)
    mark_weights(model, weights.Weights("local", str(path), "checkpoint dtype"))
    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(f"checkpoint={str(cfg.checkpoint)!r}: vocabulary {model.config.vocab_size} is smaller than the "
                          f"tokenizer's {len(tokenizer)} ids; set model=... (or model.tokenizer=...) to the one it was trained with")
    return model.to(device).eval(), tokenizer, name


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    run_ = start_run(cfg)
    task = build_task(cfg)
    policy = build_policy(cfg)
    policy = None if isinstance(policy, KeepAll) else policy  # dense: the plain cache, and its KV bytes are measured
    split = cfg.split or task.test_split
    examples = load_examples(task, split, cfg.eval.limit)
    tokenizer = load_tokenizer(cfg) if cfg.checkpoint is None else checkpoint_tokenizer(cfg, checkpoint_dir(cfg.checkpoint))
    check_prompts(task, examples, tokenizer)  # a prompt too long for task.max_prompt_tokens: said before any model loads
    if cfg.checkpoint is None:
        model, tokenizer = load_model(cfg, task, run_.device, progress=cfg.progress)
        model_name = cfg.model.name
    else:
        model, tokenizer, model_name = load_checkpoint(cfg, run_.device)
    e = cfg.eval
    console.print(f"eval: {task.name}/{split}, {len(examples)} examples, model={model_name} checkpoint={cfg.checkpoint}, "
                  f"eviction={'none' if policy is None else repr(policy)}, temperature={e.temperature}")
    rows, summary = evaluate(model, tokenizer, task, examples, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                             policy=policy, temperature=float(e.temperature), top_p=float(e.top_p), top_k=e.top_k, seed=cfg.seed,
                             progress=cfg.progress, kv_quant=cfg.kv.quant)
    name = task.primary_metric.name if hasattr(task, "primary_metric") else "reward"
    summary.update({"metric_name": name, "metric": summary[name], "metric_stderr": summary[f"{name}_stderr"],
                    "task": task.name, "split": split, "model": model_name, "checkpoint": cfg.checkpoint,
                    "eviction": "none" if policy is None else type(policy).__name__,
                    "compression": None if policy is None else float(cfg.compression), "temperature": float(e.temperature),
                    "kv_quant": cfg.kv.quant})
    record_weights(run_.dir, model, summary)
    if distributed.is_main():  # under torchrun every rank evaluated a share; rank 0 holds all the rows and writes
        write_jsonl(run_.dir / "predictions.jsonl", rows)
        write_json(run_.dir / "summary.json", summary)
        print_summary(summary, run_.dir)
    distributed.barrier()
    return summary


def _with_error(value: float, stderr) -> str:
    """`0.750 ± 0.250`; one example has no standard error, which is said (never `± nan`)."""
    if isinstance(stderr, (int, float)) and math.isfinite(stderr):
        return plus_minus(value, stderr)
    return f"{plus_minus(value)} (one example: no standard error)"


def print_summary(summary: dict, run_dir) -> None:
    name = summary["metric_name"]
    rows = [(name, _with_error(summary["metric"], summary["metric_stderr"]))]
    rows += [(k, _with_error(v, summary[f"{k}_stderr"])) for k, v in summary.items()  # the task's other metrics
             if f"{k}_stderr" in summary and k not in (name, "metric", "reward")]
    print_metrics(f"smd eval: {summary['task']}/{summary['split']} -> {run_dir}", summary,
                  ("n", "response_tokens_mean", "finished_fraction", "kv/bytes_peak", "kv/bytes_peak_dense",
                   "memory/peak_allocated_bytes", "memory/peak_rss_bytes", "tokens_per_second", "seconds"), tuple(rows))
    console.print(f"eviction={summary['eviction']} compression={summary['compression']} temperature={summary['temperature']}")
    console.print(f"weights: {summary.get('model/weights', 'unknown')}", soft_wrap=True)
