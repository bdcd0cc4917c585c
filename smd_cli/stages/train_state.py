"""Checkpoint glue of `smd train`: save with the trainer's state, find the run to resume, restore it,
and stop cleanly on divergence. The file format itself lives in `smd_cli.checkpoint`."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from smd_cli import checkpoint as ckpt
from smd_cli.io import read_jsonl, write_json
from smd_cli.learner import TrainingDiverged
from smd_cli.stages.common import ConfigError, console, to_dict

# Config keys that may differ between a run and its resumption: they change neither the updates nor the metrics.
RESUME_FREE_KEYS = ("resume", "steps", "progress", "checkpoint", "eval", "run_dir", "overrides", "cache_dir",
                    "device", "threads", "log_every", "stage_help")


def save(cfg: DictConfig, run_dir: Path, step: int, model, tokenizer, optimizer, state: dict) -> None:
    """A checkpoint whose `extra` carries what resuming needs besides weights/optimizer/RNG, all plain types."""
    extra = {"config": to_dict(cfg), **state}
    ckpt.save_checkpoint(run_dir, step, model, optimizer, tokenizer, extra=extra, keep_last=cfg.checkpoint.keep_last)


def planned_run_dir(cfg: DictConfig) -> Path | None:
    """The directory `start_run` will use (None where it will refuse to start)."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def find_resume(cfg: DictConfig) -> Path | None:
    """The run directory to continue (see `checkpoint.resume_target`), or None to start at step 0."""
    current = planned_run_dir(cfg)
    if current is None:
        return None
    try:
        target = ckpt.resume_target(cfg.resume, current)
    except FileNotFoundError as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}") from None
    if target is None and ckpt.latest_checkpoint(current) is not None:
        raise ConfigError(f"resume={cfg.resume!r} but {current} already holds checkpoints of an earlier run; "
                          "pass resume=true to continue it, or choose another hydra.run.dir")
    if target is None and cfg.resume is True:
        console.print(f"[yellow]note:[/yellow] resume=true found no checkpoint in {current} or beside it; starting at step 0")
    if target is not None and ckpt.latest_checkpoint(target).step > cfg.steps:
        raise ConfigError(f"steps={cfg.steps} is not allowed: {target} is already at step {ckpt.latest_checkpoint(target).step}")
    return target


def resume(cfg: DictConfig, run_dir: Path, launched_in: Path, model, optimizer) -> tuple[int, dict, dict]:
    """Restore the newest complete checkpoint of `run_dir`: (its step, the trainer's extra state, RNG states)."""
    try:
        latest, extra, rng, removed = ckpt.resume_run(run_dir, model, optimizer, to_dict(cfg), RESUME_FREE_KEYS,
                                                      bool(cfg.model.trust_remote_code), launched_in)
    except ValueError as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}; resume with the run's own values (its config.json) or start a new run") from None
    note = f" (removed an interrupted write: {', '.join(p.name for p in removed)})" if removed else ""
    console.print(f"resuming {run_dir} from {latest.path.name}{note}")
    return latest.step, extra, rng


def last_logged(path: Path) -> dict:
    """The newest row of `metrics.jsonl` without its step (the summary's `last/*` when no step is left to run)."""
    rows = read_jsonl(path) if path.is_file() else []
    return {k: v for k, v in rows[-1].items() if k != "step"} if rows else {}


def stop_diverged(run_dir: Path, step: int, err: TrainingDiverged, summary: dict):
    """Record the divergence in summary.json and stop, naming the step and the last good checkpoint."""
    latest = ckpt.latest_checkpoint(run_dir)
    kept = str(latest.path) if latest else "none (no checkpoint had been written yet)"
    message = f"training diverged at step {step}: {err}; stopped without applying it. Last good checkpoint: {kept}"
    summary.update({"status": "diverged", "diverged_at_step": step, "error": str(err), "last_checkpoint": latest and str(latest.path)})
    write_json(run_dir / "summary.json", summary)
    console.print(f"[red]{message}[/red]")
    raise TrainingDiverged(message) from err
