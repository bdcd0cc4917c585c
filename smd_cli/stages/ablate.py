"""`smd ablate KEY=v1,v2 ...`: one `smd train` (with its held-out evaluation) per combination of the swept
values, run through Hydra's launcher, then one table and one plot.

The sweep is `ablate.sweep` (a recipe's, e.g. `+recipe=ablate_lambda`) with the command line's `KEY=v1,v2` on top: a
key swept there replaces the recipe's values, and a plain `KEY=v` fixes a swept key to v. Every member's config is
composed before anything runs, so a wrong key or option stops the sweep at once (`config error: ...`, exit 2); what
needs the model (its architecture, prompts within its positions) each member checks when it starts, so the sweep's
own process never loads torch or transformers. Members run in `ablate.runs_dir` (default `RUN/runs/`) through
`hydra/launcher` (`smd_cli.runs.sweep`): a sweep started again, or another sweep sharing the runs directory, skips
the members already finished there, and a finished run of a member's config with the fixed held-out prompts (every run
recorded before `eval.prompts`) stands for it (`ablate.reuse_fixed_prompts`; its verdicts are about those prompts). A member that fails does not stop the others: the table gives its reason, and
once all are done the sweep exits with status 1 (`AblationFailed`). Outputs: `ablation.{md,csv,png}` (one row per
member), with a swept key of `ablate.aggregate_over` (`seed`) `ablation_mean.{md,csv,png}` (mean and standard error
over it), and `summary.json`.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from smd_cli.config.rules import check_config
from smd_cli.config.validation import ConfigError
from smd_cli.report.stats import aggregate
from smd_cli.report.sweep_tables import weights_key, write_means, write_plot, write_table
from smd_cli.runs.console import console
from smd_cli.runs.run_dirs import open_sweep_dir
from smd_cli.runs.sweep import Member, distinct, finished, launch, plan, read_json, stand_ins, user_overrides
from smd_cli.runtime import integrity
from smd_cli.runtime.failures import Interrupted
from smd_cli.runtime.records import write_json


class AblationFailed(SystemExit):
    """Some members of the sweep failed. Raised after the table, csv, plot and summary.json are written; the
    process exits with status 1 (a SystemExit: Hydra lets it through, no traceback)."""

    def __init__(self, message: str):
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


def validate(cfg: DictConfig) -> None:
    """Every key's own rule (the train keys every member shares, and `ablate.*`); cheap, before anything runs."""
    check_config(cfg, "ablate")


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    sweep, members = plan(cfg, user_overrides(cfg))  # every run's config composes, before the first one starts
    sweep_dir = open_sweep_dir(cfg)
    runs_dir = Path(cfg.ablate.runs_dir) if cfg.ablate.get("runs_dir") else sweep_dir / "runs"
    try:
        integrity.make_dir(runs_dir, "the sweep's runs")
    except integrity.Unwritable as err:
        raise ConfigError(f"ablate.runs_dir={str(runs_dir)!r} is not allowed: {err}") from None
    if cfg.ablate.reuse_fixed_prompts:
        members, fixed = stand_ins(members, runs_dir)
        if fixed:
            console.print(f"ablate: {len(fixed)} runs finished with eval.prompts=fixed (every seed the same held-out prompts, as "
                          "every run recorded before eval.prompts) stand for their members: their verdicts are about those "
                          "prompts (ablate.reuse_fixed_prompts=false runs them again, each seed on its own)", highlight=False)
    runs = distinct(members)
    done = {m.identity for m in runs if finished(runs_dir / m.name, m)}
    pending = [m for m in runs if m.identity not in done]
    console.print(f"ablate: {len(members)} combinations, {len(runs)} runs in {runs_dir} ({len(done)} finished already, "
                  f"{len(pending)} to run)")
    metrics = list(cfg.ablate.metrics)
    if pending:
        try:
            launch(pending, runs_dir)
        except KeyboardInterrupt:  # each member said where it stopped (its own summary.json); the sweep says what is left
            raise interrupted(sweep_dir, runs_dir, sweep, members, metrics, done) from None
    rows = [row(m, runs_dir, metrics, reused=m.identity in done) for m in members]
    keys = [k for k, _ in sweep] + weights_key(rows)  # + weights when the runs ran different ones: never averaged together
    write_table(sweep_dir, rows, keys, metrics)
    write_plot(sweep_dir, rows, cfg.ablate.plot_metric)
    failed = [r for r in rows if r["status"] not in ("ok", "collapsed")]
    fallen = [r for r in rows if r["status"] == "collapsed"]
    result = {"status": "completed", "runs": rows, "sweep": dict(sweep), "failed": [r["run"] for r in failed],
              "collapsed": [r["run"] for r in fallen], "runs_dir": str(runs_dir)}
    over = [k for k in keys if k in cfg.ablate.aggregate_over]
    if over:  # e.g. seed=0,1,2: one row per value of the other keys, mean and standard error over the seeds
        rest = [k for k in keys if k not in over]
        # a collapsed run is a result of its config: averaged in (leaving it out would hide it), and counted
        groups = aggregate([{**r, "status": "ok" if r["status"] == "collapsed" else r["status"]} for r in rows], rest, metrics)
        for g in groups:
            g["collapsed"] = sum(r["status"] == "collapsed" and all(str(r[k]) == str(g[k]) for k in rest) for r in rows)
        write_means(sweep_dir, groups, rest, metrics, over, cfg.ablate.plot_metric)
        result["aggregated"] = {"over": over, "keys": rest, "groups": groups}
    write_json(sweep_dir / "summary.json", result)
    console.print(f"ablation written to {sweep_dir}/ablation.md and ablation.png" + (" (and ablation_mean.*)" if over else ""))
    if fallen:
        listed = "; ".join(f"{r['run']}: {r['status_reason']}" for r in fallen)
        Console(stderr=True).print(f"[red]ablate: {len(fallen)} of {len(rows)} runs collapsed[/red] (their numbers are in the "
                                   f"tables, marked collapsed): {escape(listed)}", highlight=False)
    if failed:
        listed = "; ".join(f"{r['run']}: {r['error']}" for r in failed)
        message = (f"{len(failed)} of {len(rows)} runs failed ({listed}); the table, csv, plot and summary.json are "
                   f"in {sweep_dir}, each failed run's output in its console.log")
        Console(stderr=True).print(f"[red]ablate failed:[/red] {escape(message)}", highlight=False)
        raise AblationFailed(message)
    return result


def row(member: Member, runs_dir: Path, metrics: list[str], reused: bool) -> dict:
    """The table row of a member, from what its directory holds."""
    run_dir = runs_dir / member.name
    record, unreadable = read_json(run_dir / "member.json")
    summary, damaged = read_json(run_dir / "summary.json", summary=True)  # out of range: named, never shown as a result
    ok = finished(run_dir, member)
    if ok:  # completed, or collapsed: its numbers are what the collapsed policy does, flagged with the reason
        status = record["status"]
        error = summary.get("status_reason") if status == "collapsed" else None
    elif damaged:
        status, error = "failed", damaged
    elif summary.get("status") == "interrupted":  # Ctrl-C: not finished, and not a failure of its config either
        status, error = "interrupted", summary.get("status_reason")
    elif record.get("identity") == member.identity:
        code = record.get("returncode")
        status, error = (f"failed (exit {code})" if code else "failed"), record.get("error")
    else:
        status, error = "failed", unreadable or "the launcher did not run it to the end (no member.json)"
    return {"run": member.label, **dict(member.combo), "status": status, "error": error, "reused": reused,
            "run_status": summary.get("status") if ok else None, "status_reason": summary.get("status_reason") if ok else None,
            **{m: summary.get(m) if ok else None for m in metrics}, "dir": str(run_dir), "name": member.name}


def interrupted(sweep_dir: Path, runs_dir: Path, sweep, members: list[Member], metrics: list[str], done: set[str]) -> Interrupted:
    """Ctrl-C stopped the sweep: its summary.json says so (status "interrupted", every row as it stands), and the
    error returned says, in one line, how many runs finished and the command that continues (finished runs are kept,
    an interrupted one resumes from its last checkpoint)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rows = [row(m, runs_dir, metrics, reused=m.identity in done) for m in members]
        finished_now = sum(r["status"] in ("ok", "collapsed") for r in rows)
        write_json(sweep_dir / "summary.json", {"status": "interrupted", "status_reason": "Ctrl-C", "runs": rows, "sweep": dict(sweep),
                                                "runs_dir": str(runs_dir)})
    finally:
        signal.signal(signal.SIGINT, previous)
    typed = list(getattr(sys, "orig_argv", []))  # the command as the user typed it (`smd ablate lambda=0.1,0.8 ...`)
    given = typed[typed.index("ablate") + 1:] if "ablate" in typed else sys.argv[1:]
    again = shlex.join(["smd", "ablate", *[a for a in given if not a.startswith("hydra.run.dir=")], f"hydra.run.dir={sweep_dir}"])
    return Interrupted(f"Ctrl-C: {finished_now} of {len(rows)} runs of the sweep are finished in {runs_dir} (kept; an interrupted one "
                       f"resumes from its last checkpoint); continue with: {again}")
