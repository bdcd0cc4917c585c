"""Checkpoint glue of `smd train`: save with the trainer's state, find the run to resume, restore it,
and stop cleanly on divergence, on Ctrl-C and on a write that fails (a full disk, a file-size limit): one line naming
the step, the last checkpoint and the command that continues, and the status in `summary.json`. The file format
itself lives in `smd_cli.runtime.checkpoint`."""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.markup import escape

from smd_cli.checks import collapse
from smd_cli.config.validation import ConfigError, to_dict
from smd_cli.runs.console import console
from smd_cli.runs.run_dirs import lock_run_dir
from smd_cli.runtime import checkpoint as ckpt
from smd_cli.runtime import distributed, integrity, records
from smd_cli.runtime.failures import Interrupted, TrainingDiverged
from smd_cli.runtime.records import write_json

# Config keys that may differ between a run and its resumption: they change neither the updates nor the metrics.
RESUME_FREE_KEYS = ("resume", "steps", "progress", "checkpoint", "eval", "guard", "run_dir", "overrides", "cache_dir",
                    "device", "threads", "log_every", "stage_help")


def save(cfg: DictConfig, run_dir: Path, step: int, model, tokenizer, optimizer, state: dict, policy=None, root=None,
         protect: int | None = None) -> None:
    """A checkpoint whose `extra` carries what resuming needs besides weights/optimizer/global RNGs: plain types,
    and the eviction policy's own random state (tensors). Sharded (`root`, several processes): every rank
    gathers the full states, rank 0 writes them in the one-process layout, and a failure stops every rank.
    Rotation (`checkpoint.keep_last`) keeps the newest checkpoint at or before step `protect` as well."""
    extra = {"config": to_dict(cfg), **state, **({"policy": policy.state_dict()} if policy is not None else {})}
    model_state, optimizer_state = distributed.full_states(root, optimizer) if root is not None else (None, None)
    distributed.from_main(ckpt.save_checkpoint, run_dir, step, model, optimizer, tokenizer, extra=extra,
                          keep_last=cfg.checkpoint.keep_last, model_state=model_state, optimizer_state=optimizer_state, protect=protect)


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
    if integrity.links_problem(target):  # the run continued there (resume=PATH): checked as a named hydra.run.dir is
        raise ConfigError(f"resume={cfg.resume!r}: {integrity.links_problem(target)}")
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
    log = target / "metrics.jsonl"
    if not log.exists():  # a checkpoint copied into a folder of its own: continued, its statistics from here on (said)
        console.print(f"[yellow]note:[/yellow] {target} has no metrics.jsonl: the run's statistics (train/* in summary.json, "
                      f"train/steps_logged) will cover the steps after {latest.step} only", highlight=False, soft_wrap=True)
    try:  # the log the run continues, every step up to the checkpoint: a damaged or cut log is said now, not used
        if log.exists():
            records.read_metrics(log, through=latest.step, torn_tail_ok=True)
    except records.Damaged as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}; only a torn last line (a write cut short by a kill) is dropped "
                          "on its own: restore the file or repair that line, then resume (or start a new run)") from None
    try:
        ckpt.check_config(latest, to_dict(cfg), RESUME_FREE_KEYS)
    except ckpt.ForeignCheckpoint as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}") from None
    except ValueError as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}; resume with the run's own values (its config.json) or start a new run") from None
    return latest


def _described(corrupt: list) -> str:
    return "; ".join(f"{bad.path.name}: {problems[0]}" for bad, problems in corrupt) or "none is complete"


def resume(cfg: DictConfig, checkpoint: ckpt.Checkpoint, launched_in: Path, model) -> tuple[dict, dict, dict]:
    """Restore `checkpoint`'s weights (from `find_resume`): (the trainer's extra state, RNG states, the optimizer's
    state dict). Every rank reads the same files; rank 0 records the resumption."""
    try:
        extra, rng, optimizer_state = ckpt.resume_run(checkpoint, model, bool(cfg.model.trust_remote_code),
                                                      launched_in if distributed.is_main() else None)
    except ckpt.ForeignCheckpoint as err:
        raise ConfigError(f"resume={cfg.resume!r}: {err}") from None
    console.print(f"resuming {checkpoint.path.parent.parent} from {checkpoint.path.name}")
    return extra, rng, optimizer_state


class PolicyCollapsed(TrainingDiverged):
    """The policy collapsed (`smd_cli.checks.collapse`); raised after summary.json says so (status "collapsed")."""

    label = "training collapsed"


class CollapseGuard:
    """Beside the learner's NaN guard: non-finite weights after a step stop the run as diverged, and a policy that
    has certainly collapsed (`smd_cli.checks.collapse.verdict` over the rows logged so far, `window` steps) stops it as
    collapsed. `rows` are the run's logged steps before this process's first (a resumed run judges its whole
    history, so that it stops where an uninterrupted one would)."""

    def __init__(self, window: int, rows: list[dict] | None = None):
        self.window, self.rows, self.last_good = window, list(rows or []), None

    def check_weights(self, step: int, model) -> None:
        """TrainingDiverged (every rank at once) when step `step` (1-based) left non-finite weights."""
        largest = torch._foreach_norm([distributed.local(p) for p in model.parameters()], float("inf"))  # one read-only pass; NaN and
        finite = bool(torch.isfinite(torch.stack(largest)).all())  # inf propagate (isfinite per tensor: a bool copy of each, ~2x slower)
        if distributed.total(float(not finite)):
            self.last_good = step - 1
            raise TrainingDiverged("the weights are non-finite after the optimizer step")

    def after_step(self, step: int, metrics: dict) -> collapse.Collapse | None:
        """Record step `step`'s metrics (the learner's and the rollout's); the collapse when it is now certain."""
        self.rows.append({"step": step, **metrics})
        found = collapse.verdict(self.rows, self.window)
        return found if found is not None and found.certain else None

    def at_end(self, held_out: tuple[float, float] | None) -> collapse.Collapse | None:
        """The collapse the finished run shows (`held_out`: reward before and after, when measured; one that rose
        overrules the training signal), or None."""
        return collapse.verdict(self.rows, self.window, end=True, held_out=held_out)

    def protect(self) -> int | None:
        """While suspect steps run (a silent streak, or a falling reward: `collapse.suspect_since`), the newest step
        whose weights predate them: its checkpoint survives rotation."""
        since = collapse.suspect_since(self.rows, self.window) if self.window else None
        return None if since is None else max(since - 2, 0)

    def note(self) -> str:
        return (collapse.converged(self.rows) or "") if self.rows else ""


def last_good_checkpoint(run_dir: Path, last_good: int | None) -> tuple[ckpt.Checkpoint | None, str]:
    """(the newest intact checkpoint at or before step `last_good`, the words that name it, or say why there is
    none: nothing written yet, or only checkpoints of weights that were already bad)."""
    latest, _ = ckpt.newest_intact(run_dir, max_step=last_good)
    if latest is not None:
        return latest, f"{latest.path} (step {latest.step})"
    later = [c.path.name for c in ckpt.list_checkpoints(run_dir) if last_good is not None and c.step > last_good]
    written = f"; {', '.join(later)} hold weights from after it" if later else ""
    if last_good == 0:
        return None, f"none: the run's starting weights were the last good ones (its warm start, or the model it loaded){written}"
    if last_good is None and not later:
        return None, "none (no checkpoint had been written yet)"
    return None, f"none at or before step {last_good}{written}"


def stop_diverged(run_dir: Path, step: int, err: TrainingDiverged, summary: dict, last_good: int | None = None):
    """Record the divergence in summary.json and stop, naming the step and the last good checkpoint (the newest
    intact one at or before step `last_good` when given)."""
    latest, kept = last_good_checkpoint(run_dir, last_good)
    message = f"training diverged at step {step}: {err}; stopped. Last good checkpoint: {kept}"
    summary.update({"status": "diverged", "status_reason": str(err), "diverged_at_step": step, "error": str(err),
                    "last_checkpoint": latest and str(latest.path)})
    if distributed.is_main():
        write_json(run_dir / "summary.json", summary)
    console.print(f"[red]{escape(message)}[/red]")
    raise TrainingDiverged(message) from err


def collapsed(run_dir: Path, found: collapse.Collapse, summary: dict) -> str:
    """Put the collapse in `summary` (status "collapsed", its reason, where it began, the last good checkpoint);
    returns the one-line message."""
    latest, kept = last_good_checkpoint(run_dir, found.last_good_step)
    summary.update({"status": "collapsed", "status_reason": found.reason, "collapsed_at_step": found.step,
                    "collapse_since_step": found.since, "stopped": found.certain, "last_checkpoint": latest and str(latest.path)})
    what = "stopped" if found.certain else "found at the end of the run"
    return (f"the policy collapsed at step {found.since} ({what} at step {found.step}): {found.reason}. "
            f"Last good checkpoint: {kept}")


@dataclass
class Whereabouts:
    """Where a training run is, for the line and the summary a stop writes (`stopped`): its directory once known, and
    its summary so far (the held-out evaluations before training)."""

    run_dir: Path | None = None
    summary: dict = field(default_factory=dict)


def resume_command(cfg: DictConfig, run_dir: Path) -> str:
    """The command line that continues the run in `run_dir` (its own overrides, `resume=true`)."""
    given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else list(cfg.get("overrides") or [])
    kept = [o for o in given if not o.startswith(("resume=", "hydra.run.dir=", "run_dir=", "+run_dir="))]
    return shlex.join(["smd", "train", *kept, f"hydra.run.dir={run_dir}", "resume=true"])


def stopped(cfg: DictConfig, where: Whereabouts, err: BaseException) -> Exception:
    """The run stopped by Ctrl-C (`err` a KeyboardInterrupt: status "interrupted") or by a write that failed (status
    "failed"): `summary.json` says so with the last step logged, the newest intact checkpoint and the command that
    continues (rank 0), and the returned error says it in one line. A second Ctrl-C meanwhile is ignored."""
    interrupted = isinstance(err, KeyboardInterrupt)
    said = err.strerror if isinstance(err, OSError) and err.strerror else str(err)  # the message, not "[Errno 28] ..."
    what = "Ctrl-C" if interrupted else said  # after the CLI's label: "interrupted: Ctrl-C at step 3 ...", "disk full: ..."
    if where.run_dir is None:
        message = f"{what} before the run started; nothing was trained"
        return Interrupted(message) if interrupted else err
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if interrupted else None
    try:
        run_dir = where.run_dir
        try:
            rows = records.read_metrics(run_dir / "metrics.jsonl", torn_tail_ok=True) if (run_dir / "metrics.jsonl").is_file() else []
        except records.Damaged:
            rows = []
        step = rows[-1]["step"] if rows else 0
        latest, _ = ckpt.newest_intact(run_dir) if distributed.is_main() else (None, [])
        kept = f"{latest.path} (step {latest.step})" if latest else "none yet (resuming starts again at step 0)"
        again = resume_command(cfg, run_dir)
        reason = f"{'interrupted by Ctrl-C' if interrupted else said}, at step {step} of {cfg.steps}"
        summary = {**where.summary, "status": "interrupted" if interrupted else "failed", "status_reason": reason,
                   "steps": cfg.steps, "steps_run": step, "last_checkpoint": latest and str(latest.path), "resume_command": again}
        if not interrupted:
            summary["error"] = said
        if distributed.is_main():
            try:
                write_json(run_dir / "summary.json", summary)
            except (OSError, ValueError):  # the disk that stopped the run may not take this either: the line below says it all
                pass
        at = f"{what} at step {step}" if interrupted else f"{what.rstrip('.')}. Stopped at step {step}"
        message = f"{at} of {cfg.steps}; last checkpoint: {kept}; continue with: {again}"
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        return Interrupted(message)
    return type(err)(message) if isinstance(err, (integrity.DiskFull, integrity.FileTooLarge)) else integrity.WriteFailed(message)
