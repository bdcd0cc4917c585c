"""`smd ablate KEY=v1,v2 ...`: train (and evaluate) once per combination, then one table and one plot.

Each run is a separate `smd train` process with the swept values and every other override of the
command line, written to `RUN/runs/KEY=VALUE,...`; a failed run is reported in the table, not hidden.
Outputs: `ablation.md` and `ablation.csv` (one row per run), `ablation.png` (training reward curves and
the chosen metric per run), `summary.json`.
"""

from __future__ import annotations

import csv
import itertools
import re
import json
import subprocess
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.table import Table

from smd_cli.io import read_jsonl, write_atomic, write_json
from smd_cli.stages.common import ConfigError, console, start_run


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


def run(cfg: DictConfig) -> dict:
    sweep = parse_sweep(list(cfg.ablate.sweep))
    run_ = start_run(cfg)
    base = user_overrides(cfg)
    rows = []
    for combo in itertools.product(*[[(key, v) for v in values] for key, values in sweep]):
        name = ",".join(f"{k}={v}" for k, v in combo)
        run_dir = run_.dir / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", name.replace("=", "-"))
        command = [sys.executable, "-m", "smd_cli.cli", "train", *base, *(f"{k}={v}" for k, v in combo), f"hydra.run.dir={run_dir}"]
        console.rule(f"ablate: {name}")
        done = subprocess.run(command)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        rows.append({"run": name, **dict(combo), "status": "ok" if done.returncode == 0 else f"failed ({done.returncode})",
                     **{m: summary.get(m) for m in cfg.ablate.metrics}, "dir": str(run_dir)})
    keys = [k for k, _ in sweep]
    write_table(run_.dir, rows, keys, list(cfg.ablate.metrics))
    plot(run_.dir, rows, cfg.ablate.plot_metric)
    result = {"runs": rows, "sweep": dict(sweep)}
    write_json(run_.dir / "summary.json", result)
    console.print(f"ablation written to {run_.dir}/ablation.md and ablation.png")
    return result


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def write_table(out: Path, rows: list[dict], keys: list[str], metrics: list[str]) -> None:
    columns = keys + metrics + ["status"]
    table = Table(title="smd ablate")
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns])
    console.print(table)
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    write_atomic(out / "ablation.md", "\n".join(md) + "\n")
    with (out / "ablation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", *columns, "dir"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(out: Path, rows: list[dict], metric: str) -> None:
    """Left: training reward per step for each run; right: `metric` per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        path = Path(r["dir"]) / "metrics.jsonl"
        if path.is_file():
            steps = read_jsonl(path)
            left.plot([s["step"] for s in steps], [s.get("reward") for s in steps], label=r["run"])
    left.set(xlabel="step", ylabel="training reward", title="reward during training")
    if left.lines:
        left.legend(fontsize=8)
    values = [r.get(metric) if isinstance(r.get(metric), (int, float)) else 0.0 for r in rows]
    right.bar(range(len(rows)), values, color="tab:blue")
    right.set_xticks(range(len(rows)), [r["run"] for r in rows], rotation=20, ha="right", fontsize=8)
    right.set(ylabel=metric, title=metric)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)
