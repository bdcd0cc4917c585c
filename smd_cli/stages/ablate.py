"""`smd ablate KEY=v1,v2 ...`: train (and evaluate) once per combination, then one table and one plot.

Each run is a separate `smd train` process with the swept values and every other override of the
command line, written to `RUN/runs/KEY-VALUE,...`. Every combination's config is composed before the
first run starts, so a wrong key or option stops the sweep at once (`config error: ...`, exit 2).
A run that fails does not stop the others: its stderr is streamed to the terminal as it comes and also
kept, and the table gives the reason (the `error` of its summary.json, else the error message that ends
its stderr; the whole of it is in its `stderr.log`). Outputs: `ablation.md` and `ablation.csv` (one row
per run), `ablation.png` (training reward curves and the chosen metric per run; a failed run has no bar,
only a red "failed" mark, never a 0), `summary.json`. A swept key of `ablate.aggregate_over` (`seed`) is
averaged over: `ablation_mean.{md,csv,png}` give each other combination's mean and standard error. When a
run failed, `smd ablate` exits with status 1 after writing all of them (`AblationFailed`).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from smd_cli.io import read_jsonl, write_atomic, write_json
from smd_cli.stages.common import ROOT, ConfigError, check, console, start_run

STDERR_TAIL = 1 << 20  # bytes of a run's stderr kept for its reason and stderr.log
REASON_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_ERROR_HEAD = re.compile(r"^(config error:|training diverged:|error:|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Diverged)\b)")


class AblationFailed(SystemExit):
    """Some runs of the sweep failed. Raised after the table, csv, plot and summary.json are written; the
    process exits with status 1 (a SystemExit: Hydra lets it through, no traceback)."""

    def __init__(self, message: str):
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


def parse_sweep(specs: list[str]) -> list[tuple[str, list[str]]]:
    """["lambda=0.1,0.8", "algo=smd,tis"] -> [("lambda", ["0.1", "0.8"]), ("algo", ["smd", "tis"])]."""
    if not specs:
        raise ConfigError("ablate.sweep=[] is not allowed: give at least one KEY=v1,v2 (e.g. `smd ablate lambda=0.1,0.8`)")
    sweep = []
    for spec in specs:
        key, sep, values = str(spec).partition("=")
        options = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key or not options:
            raise ConfigError(f"ablate.sweep entry {spec!r} is not allowed: write KEY=v1,v2,...")
        sweep.append((key.strip(), options))
    return sweep


def user_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides other than the sweep itself (passed on to every train run)."""
    given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else list(cfg.get("overrides") or [])
    return [o for o in given if not o.startswith(("ablate.", "run_dir=", "+run_dir=", "overrides=", "+overrides="))]


def validate(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """The sweep, and the ablate options; cheap, before anything runs."""
    sweep = parse_sweep(list(cfg.ablate.sweep))
    metrics = cfg.ablate.metrics
    check(metrics is not None and len(metrics) >= 1 and all(isinstance(m, str) and m for m in metrics), "ablate.metrics",
          metrics, "a non-empty list of summary.json keys, e.g. [eval/reward_after]")
    check(isinstance(cfg.ablate.plot_metric, str) and cfg.ablate.plot_metric, "ablate.plot_metric", cfg.ablate.plot_metric,
          "a summary.json key, e.g. eval/reward_after")
    return sweep


def check_members(base: list[str], combos: list[tuple[str, tuple]]) -> None:
    """Compose every run's train config now (unknown keys, options, values of the wrong kind), so that a
    mistake stops the sweep before the first run rather than failing every run after its start-up."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def compose_all() -> None:
        for name, combo in combos:
            try:
                compose(config_name="train", overrides=[*base, *(f"{k}={v}" for k, v in combo)])
            except Exception as err:  # Hydra's override and composition errors
                raise ConfigError(f"ablate run {name}: {_chain(err)}") from None

    if GlobalHydra.instance().is_initialized():  # under `smd ablate`: the CLI's own search path and recipes
        compose_all()
    else:  # called as a function (tests)
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            compose_all()


def _chain(err: BaseException) -> str:
    """An error and its causes in one line, without OmegaConf's full_key / object_type detail lines."""
    parts = []
    while err is not None:
        lines = [line.strip() for line in str(err).split("Config search path")[0].splitlines() if line.strip()]
        text = " ".join(line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type=")))
        if text and text not in parts:
            parts.append(text)
        err = err.__cause__
    return ": ".join(parts)


def member_command(base: list[str], combo: tuple, run_dir: Path) -> list[str]:
    """The `smd train` command line of one run."""
    return [sys.executable, "-m", "smd_cli.cli", "train", *base, *(f"{k}={v}" for k, v in combo), f"hydra.run.dir={run_dir}"]


def run_streaming(command: list[str]) -> tuple[int, str]:
    """Run `command` with its stdout on ours and its stderr copied to ours as it comes; (exit status, the
    last STDERR_TAIL bytes of its stderr)."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    out = getattr(sys.stderr, "buffer", None)
    tail = bytearray()
    try:
        while chunk := os.read(proc.stderr.fileno(), 65536):
            if out is not None:
                out.write(chunk)
                out.flush()
            else:  # a replaced sys.stderr (e.g. captured) takes text
                sys.stderr.write(chunk.decode("utf-8", "replace"))
            tail += chunk
            if len(tail) > 2 * STDERR_TAIL:
                del tail[:-STDERR_TAIL]
        returncode = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: do not leave the run behind
            proc.kill()
            proc.wait()
        proc.stderr.close()
    return returncode, bytes(tail[-STDERR_TAIL:]).decode("utf-8", "replace")


def error_message(stderr: str) -> str:
    """The error that ends a run's stderr: from the last `config error:` / `XError:` line of its last
    paragraph to the end (lines that rich wrapped are joined back), else that paragraph; '' if none."""
    lines = [_ANSI.sub("", line).rstrip() for line in re.split(r"\r\n|\r|\n", stderr)]
    lines = [line for line in lines if "HYDRA_FULL_ERROR" not in line]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return ""
    block = lines[max((i + 1 for i, line in enumerate(lines) if not line.strip()), default=0) :]
    heads = [i for i, line in enumerate(block) if _ERROR_HEAD.match(line.strip())]
    text = " ".join(line.strip() for line in block[heads[-1] if heads else 0 :])
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def failure_reason(returncode: int, stderr: str, summary: dict) -> str:
    """Why a run failed, in one line: its summary's `error`, else the end of its stderr, else its exit."""
    if isinstance(summary.get("error"), str) and summary["error"].strip():
        text = " ".join(summary["error"].split())
        return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."
    message = error_message(stderr)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        killed = f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
        return f"{killed}: {message}" if message else killed
    return message or f"exit status {returncode}, nothing on stderr"


def read_summary(path: Path) -> tuple[dict, str | None]:
    """(the run's summary.json, or {}; why it could not be read, if it exists but is not a JSON object)."""
    if not path.is_file():
        return {}, None
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, f"unreadable summary.json ({err})"
    return (summary, None) if isinstance(summary, dict) else ({}, "summary.json is not a JSON object")


def run(cfg: DictConfig) -> dict:
    sweep = validate(cfg)
    base = user_overrides(cfg)
    combos = [(",".join(f"{k}={v}" for k, v in combo), combo)
              for combo in itertools.product(*[[(key, v) for v in values] for key, values in sweep])]
    check_members(base, combos)  # every run's config composes, before the first one starts
    run_ = start_run(cfg)
    metrics = list(cfg.ablate.metrics)
    rows = []
    for name, combo in combos:
        run_dir = run_.dir / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", name.replace("=", "-"))
        (run_dir / "summary.json").unlink(missing_ok=True)  # a previous attempt's result is not this run's
        console.rule(f"ablate: {name}")
        returncode, stderr = run_streaming(member_command(base, combo, run_dir))
        summary, unreadable = read_summary(run_dir / "summary.json")
        ok = returncode == 0 and not unreadable
        error = None
        if not ok:
            error = unreadable if returncode == 0 else failure_reason(returncode, stderr, summary)
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / "stderr.log", stderr)
        status = "ok" if ok else (f"failed (exit {returncode})" if returncode else "failed")
        rows.append({"run": name, **dict(combo), "status": status, "error": error,
                     **{m: summary.get(m) for m in metrics}, "dir": str(run_dir)})
    keys = [k for k, _ in sweep]
    write_table(run_.dir, rows, keys, metrics)
    plot(run_.dir, rows, cfg.ablate.plot_metric)
    failed = [r for r in rows if r["status"] != "ok"]
    result = {"runs": rows, "sweep": dict(sweep), "failed": [r["run"] for r in failed]}
    over = [k for k in keys if k in cfg.ablate.aggregate_over]
    if over:  # e.g. seed=0,1,2: one row per value of the other keys, mean and standard error over the seeds
        groups = aggregate(rows, [k for k in keys if k not in over], metrics)
        write_means(run_.dir, groups, [k for k in keys if k not in over], metrics, over, cfg.ablate.plot_metric)
        result["aggregated"] = {"over": over, "groups": groups}
    write_json(run_.dir / "summary.json", result)
    console.print(f"ablation written to {run_.dir}/ablation.md and ablation.png")
    if failed:
        listed = "; ".join(f"{r['run']}: {r['error']}" for r in failed)
        message = (f"{len(failed)} of {len(rows)} runs failed ({listed}); the table, csv, plot and summary.json are "
                   f"in {run_.dir}, each failed run's stderr in its stderr.log")
        Console(stderr=True).print(f"[red]ablate failed:[/red] {message}", highlight=False)
        raise AblationFailed(message)
    return result


def aggregate(rows: list[dict], keys: list[str], metrics: list[str]) -> list[dict]:
    """Rows grouped by the values of `keys` (in first-seen order): per metric the mean over the group's finished
    runs that report it and its standard error `std / sqrt(n)` (sample std, n - 1; None below two runs), with
    `runs` (in the group) and `n` (finished)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for values, members in groups.items():
        done = [r for r in members if r["status"] == "ok"]
        group = {**dict(zip(keys, values)), "runs": len(members), "n": len(done)}
        for m in metrics:
            xs = [float(r[m]) for r in done if isinstance(r.get(m), (int, float)) and math.isfinite(r[m])]
            mean = sum(xs) / len(xs) if xs else None
            se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else None
            group[m], group[f"{m} se"] = mean, se
        out.append(group)
    return out


def write_means(out: Path, groups: list[dict], keys: list[str], metrics: list[str], over: list[str], metric: str) -> None:
    """`ablation_mean.md` / `.csv` (mean +- standard error over `over`, n finished of runs) and `ablation_mean.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pm(g: dict, m: str) -> str:
        mean, se = g.get(m), g.get(f"{m} se")
        return "-" if mean is None else f"{mean:.4g}" + ("" if se is None else f" ± {se:.2g}")

    columns = keys + metrics + ["n"]
    table = Table(title=f"smd ablate: mean ± standard error over {', '.join(over)}")
    for c in columns:
        table.add_column(c, justify="right")
    rows_md = []
    for g in groups:
        cells = [str(g[k]) for k in keys] + [pm(g, m) for m in metrics] + [f"{g['n']}/{g['runs']}"]
        table.add_row(*cells)
        rows_md.append("| " + " | ".join(cells) + " |")
    console.print(table)
    write_atomic(out / "ablation_mean.md", "\n".join([f"Mean ± standard error over {', '.join(over)} (n finished / runs).", "",
                                                      "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows_md]) + "\n")
    with (out / "ablation_mean.csv").open("w", newline="") as f:
        fields = [*keys, *[c for m in metrics for c in (m, f"{m} se")], "n", "runs"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(groups)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) + 2), 4))
    for i, g in enumerate(groups):
        if g.get(metric) is not None:
            bar = ax.bar(i, g[metric], yerr=g.get(f"{metric} se") or 0.0, capsize=4, color="tab:blue")
            ax.bar_label(bar, [f"{g[metric]:.3g} (n={g['n']})"], fontsize=8, label_type="center", color="white")
        else:
            ax.text(i, 0.03, "no run finished", transform=ax.get_xaxis_transform(), rotation=90, ha="center", color="tab:red")
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xticks(range(len(groups)), [",".join(f"{k}={g[k]}" for k in keys) or "all" for g in groups], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: mean ± standard error over {', '.join(over)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ablation_mean.png", dpi=120)
    plt.close(fig)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def write_table(out: Path, rows: list[dict], keys: list[str], metrics: list[str]) -> None:
    """The rich table, ablation.md and ablation.csv; the `error` column when a run failed (always in the csv)."""
    columns = keys + metrics + ["status"] + (["error"] if any(r.get("error") for r in rows) else [])
    table = Table(title="smd ablate")
    for c in columns:
        table.add_column(c, justify="left" if c == "error" else "right", overflow="fold")
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns], style="red" if r["status"] != "ok" else None)
    console.print(table)

    def cell(r: dict, c: str) -> str:
        return _fmt(r.get(c)).replace("|", "\\|").replace("\n", " ")

    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    write_atomic(out / "ablation.md", "\n".join(md) + "\n")
    with (out / "ablation.csv").open("w", newline="") as f:
        fields = ["run", *keys, *metrics, "status", "error", "dir"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(out: Path, rows: list[dict], metric: str) -> dict[str, float]:
    """Left: training reward per step for each run (a failed run's partial curve dashed); right: `metric`
    per run, a bar for each run that finished with a number, a red "failed" (or grey "n/a") mark in place
    of the bar otherwise, never a 0. Returns the bars drawn, run -> height."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        path = Path(r["dir"]) / "metrics.jsonl"
        if path.is_file():
            try:
                steps = read_jsonl(path)
            except (OSError, ValueError):  # a run killed mid-line
                continue
            failed = r["status"] != "ok"
            left.plot([s.get("step") for s in steps], [s.get("reward") for s in steps], linestyle="--" if failed else "-",
                      label=r["run"] + (" (failed)" if failed else ""))
    left.set(xlabel="step", ylabel="training reward", title="reward during training")
    if left.lines:
        left.legend(fontsize=8)
    bars: dict[str, float] = {}
    marks = right.get_xaxis_transform()  # x in data units, y in axes fraction
    for i, r in enumerate(rows):
        value = r.get(metric)
        if r["status"] == "ok" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            right.bar_label(right.bar(i, value, color="tab:blue"), fmt="%.3g", fontsize=8)  # a real 0 reads "0"
            bars[r["run"]] = float(value)
        else:
            failed = r["status"] != "ok"
            right.text(i, 0.03, "failed" if failed else "n/a", transform=marks, rotation=90, ha="center", va="bottom",
                       color="tab:red" if failed else "grey", fontsize=9, fontweight="bold" if failed else "normal")
    right.set_xlim(-0.6, len(rows) - 0.4)
    right.set_xticks(range(len(rows)), [r["run"] for r in rows], rotation=20, ha="right", fontsize=8)
    for label, r in zip(right.get_xticklabels(), rows):
        if r["status"] != "ok":
            label.set_color("tab:red")
    title = metric + (" (failed runs: no bar)" if any(r["status"] != "ok" for r in rows) else "")
    right.set(ylabel=metric, title=title)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)
    return bars
