"""Checkpoint glue of `smd train`: save with the trainer's state, find the run to resume, restore it,
and stop cleanly on divergence. The file format itself lives in `smd_cli.checkpoint`."""

from __future__ import annotations

from pathlib import Path

import torch

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from smd_cli import checkpoint as ckpt
from smd_cli import distributed
from smd_cli.io import read_jsonl, write_json
from smd_cli.learner import TrainingDiverged
from smd_cli.stages.common import ConfigError, console, lock_run_dir, to_dict

# Config keys that may differ between a run and its resumption: they change neither the updates nor the metrics.
RESUME_FREE_KEYS = ("resume", "steps", "progress", "checkpoint", "eval", "guard", "run_dir", "overrides", "cache_dir",
                    "device", "threads", "log_every", "stage_help")


def save(cfg: DictConfig, run_dir: Path, step: int, model, tokenizer, optimizer, state: dict, policy=None, root=None) -> None:
    """A checkpoint whose `extra` carries what resuming needs besides weights/optimizer/global RNGs: plain types,
    and the eviction policy's own random state (tensors). Sharded (`root`, several processes): every rank
    gathers the full states, rank 0 writes them in the one-process layout, and a failure stops every rank."""
    extra = {"config": to_dict(cfg), **state, **({"policy": policy.state_dict()} if policy is not None else {})}
    model_state, optimizer_state = distributed.full_states(root, optimizer) if root is not None else (None, None)
    distributed.from_main(ckpt.save_checkpoint, run_dir, step, model, optimizer, tokenizer, extra=extra,
                          keep_last=cfg.checkpoint.keep_last, model_state=model_state, optimizer_state=optimizer_state)


def save_final(run_dir: Path, model, tokenizer, root=None) -> None:
    """`RUN/final` (rank 0 writes the gathered weights when sharded)."""
    model_state = distributed.in_compute_dtype(root, distributed.full_model_state(root)) if root is not None else None
    distributed.from_main(ckpt.save_final, run_dir, model, tokenizer, model_state)


def planned_run_dir(cfg: DictConfig) -> Path | None:
    """The directory `start_run` will use (None where it will refuse to start)."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def named_by_user(cfg: DictConfig) -> bool:
    """Whether the run directory was chosen on the command line (`hydra.run.dir=`, or `run_dir` set by a caller)
    rather than the fresh timestamped default: `resume=true` then never looks beyond it."""
    if cfg.get("run_dir"):
        return True
    return HydraConfig.initialized() and any(o.startswith("hydra.run.dir=") for o in HydraConfig.get().overrides.hydra)


def find_resume(cfg: DictConfig) -> ckpt.Checkpoint | None:
    """The checkpoint to continue from (see `checkpoint.resume_target`), or None to start at step 0.

    Before any model is built: the run directory is locked for this process, an interrupted write is removed,
    the checkpoints are verified newest first (a corrupt one is moved aside with a warning, and the newest
    intact one is used), and the checkpoint's config is compared with this one."""
    current = planned_run_dir(cfg)
    if current is None:
        return None
    try:
        target = ckpt.resume_target(cfg.resume, current, named=named_by_user(cfg))
    except FileNotFoundError as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}") from None
    if target is None and ckpt.latest_checkpoint(current) is not None:
        raise ConfigError(f"resume={cfg.resume!r} but {current} already holds checkpoints of an earlier run; "
                          "pass resume=true to continue it, or choose another hydra.run.dir")
    if target is None:
        if cfg.resume is True:
            console.print(f"[yellow]note:[/yellow] resume=true found no checkpoint in {current}"
                          f"{'' if named_by_user(cfg) else ' or beside it'}; starting at step 0")
        return None
    lock_run_dir(target)
    removed = ckpt.remove_partial(target)
    if removed:
        console.print(f"removed an interrupted write in {target}: {', '.join(p.name for p in removed)}")
    latest, corrupt = ckpt.newest_intact(target)
    if latest is None and target != current:  # nothing to continue there: leave that directory as it is
        if cfg.resume is not True:
            raise ConfigError(f"resume={cfg.resume!r}: {target} holds no intact checkpoint ({_described(corrupt)})")
        console.print(f"[yellow]warning:[/yellow] {target} holds no intact checkpoint ({_described(corrupt)}); starting at step 0")
        return None
    for bad, problems in corrupt:
        moved = ckpt.set_aside(bad)
        console.print(f"[yellow]warning:[/yellow] {bad.path} is corrupt ({'; '.join(problems[:3])}); moved it to {moved.name}")
    if latest is None:
        console.print(f"[yellow]warning:[/yellow] no intact checkpoint is left in {target}; starting at step 0")
        return None
    if corrupt:
        console.print(f"[yellow]warning:[/yellow] resuming from the newest intact checkpoint, {latest.path.name}")
    if latest.step > cfg.steps:
        raise ConfigError(f"steps={cfg.steps} is not allowed: {target} is already at step {latest.step}")
    try:
        ckpt.check_config(latest, to_dict(cfg), RESUME_FREE_KEYS)
    except ValueError as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}; resume with the run's own values (its config.json) or start a new run") from None
    return latest


def _described(corrupt: list) -> str:
    return "; ".join(f"{bad.path.name}: {problems[0]}" for bad, problems in corrupt) or "none is complete"


def resume(cfg: DictConfig, checkpoint: ckpt.Checkpoint, launched_in: Path, model) -> tuple[dict, dict, dict]:
    """Restore `checkpoint`'s weights (from `find_resume`): (the trainer's extra state, RNG states, the optimizer's
    state dict). Every rank reads the same files; rank 0 records the resumption."""
    extra, rng, optimizer_state = ckpt.resume_run(checkpoint, model, bool(cfg.model.trust_remote_code),
                                                  launched_in if distributed.is_main() else None)
    console.print(f"resuming {checkpoint.path.parent.parent} from {checkpoint.path.name}")
    return extra, rng, optimizer_state


def last_logged(path: Path) -> dict:
    """The newest row of `metrics.jsonl` without its step (the summary's `last/*` when no step is left to run)."""
    rows = read_jsonl(path) if path.is_file() else []
    return {k: v for k, v in rows[-1].items() if k != "step"} if rows else {}


class CollapseGuard:
    """Beside the learner's NaN guard: stops a run whose weights are non-finite after a step, or whose gradient
    norm has been exactly 0 for `steps` steps in a row: no learning signal at all, the state an absurd learning
    rate leaves a model in (saturated logits), or every group's rewards equal step after step. `last_good` is
    then the newest step whose weights predate it."""

    def __init__(self, steps: int, run_dir: Path):
        self.steps, self.run_dir, self.streak, self.last_good = steps, run_dir, 0, None

    def after_step(self, step: int, model, metrics: dict) -> None:
        """Check step `step` (1-based) after its update; TrainingDiverged to stop (every rank at once)."""
        finite = bool(torch.stack([torch.isfinite(distributed.local(p)).all() for p in model.parameters()]).all())
        if distributed.total(float(not finite)):
            self.last_good = step - 1
            raise TrainingDiverged("the weights are non-finite after the optimizer step")
        self.streak = self.streak + 1 if metrics.get("grad_norm") == 0 else 0
        if self.steps and self.streak >= self.steps:
            self.last_good = step - self.streak - 1  # the update before the first silent step did it
            raise TrainingDiverged(f"no learning signal: the gradient norm has been exactly 0 for {self.streak} steps in a "
                                   "row (a collapsed policy, or every group's rewards equal each step); "
                                   f"guard.collapse_steps={self.steps}, 0 turns this check off")


def stop_diverged(run_dir: Path, step: int, err: TrainingDiverged, summary: dict, last_good: int | None = None):
    """Record the divergence in summary.json and stop, naming the step and the last good checkpoint (the newest
    intact one at or before step `last_good` when given)."""
    latest, _ = ckpt.newest_intact(run_dir, max_step=last_good)
    kept = str(latest.path) if latest else "none (no checkpoint had been written yet)"
    message = f"training diverged at step {step}: {err}; stopped. Last good checkpoint: {kept}"
    summary.update({"status": "diverged", "diverged_at_step": step, "error": str(err), "last_checkpoint": latest and str(latest.path)})
    if distributed.is_main():
        write_json(run_dir / "summary.json", summary)
    console.print(f"[red]{message}[/red]")
    raise TrainingDiverged(message) from err
