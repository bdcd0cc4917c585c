"""The tables and plots of a sweep (`smd ablate`): one row per run, and means over seeds.

Rows are plain dicts (`run`, the swept keys, `status`, `error`, the chosen summary metrics, `dir`); a failed
run is shown with its reason and never drawn as a 0. Library code: no Hydra.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from smd_cli.io import read_jsonl, write_atomic

console = Console(width=None if sys.stdout.isatty() else 140)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def _pm(group: dict, metric: str) -> str:
    mean, se = group.get(metric), group.get(f"{metric} se")
    return "-" if mean is None else f"{mean:.4g}" + ("" if se is None else f" ± {se:.2g}")


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table (cells with `|` or newlines escaped)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]) + "\n"


def write_table(out: Path, rows: list[dict], keys: list[str], metrics: list[str]) -> None:
    """The rich table, ablation.md and ablation.csv; the `error` column when a run failed (always in the csv)."""
    columns = keys + metrics + ["status"] + (["error"] if any(r.get("error") for r in rows) else [])
    table = Table(title="smd ablate")
    for c in columns:
        table.add_column(c, justify="left" if c == "error" else "right", overflow="fold")
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns], style="red" if r["status"] != "ok" else None)
    console.print(table)
    write_atomic(out / "ablation.md", markdown(columns, [[_fmt(r.get(c)) for c in columns] for r in rows]))
    with (out / "ablation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", *keys, *metrics, "status", "error", "dir"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_means(out: Path, groups: list[dict], keys: list[str], metrics: list[str], over: list[str], metric: str) -> None:
    """`ablation_mean.md` / `.csv` (mean +- standard error over `over`, n finished of runs) and `ablation_mean.png`."""
    plt = _pyplot()
    columns = keys + metrics + ["n"]
    table = Table(title=f"smd ablate: mean ± standard error over {', '.join(over)}")
    for c in columns:
        table.add_column(c, justify="right")
    cells = [[str(g[k]) for k in keys] + [_pm(g, m) for m in metrics] + [f"{g['n']}/{g['runs']}"] for g in groups]
    for c in cells:
        table.add_row(*c)
    console.print(table)
    write_atomic(out / "ablation_mean.md", f"Mean ± standard error over {', '.join(over)} (n finished / runs).\n\n" + markdown(columns, cells))
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


def write_plot(out: Path, rows: list[dict], metric: str) -> dict[str, float]:
    """ablation.png. Left: training reward per step for each run (a failed run's partial curve dashed); right:
    `metric` per run, a bar for each run that finished with a number, a red "failed" (or grey "n/a") mark in
    place of the bar otherwise, never a 0. Returns the bars drawn, run -> height."""
    plt = _pyplot()
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
    if left.lines and len(left.lines) <= 12:
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
    right.set_xticks(range(len(rows)), [r["run"] for r in rows], rotation=20 if len(rows) <= 12 else 90, ha="right", fontsize=8)
    for label, r in zip(right.get_xticklabels(), rows):
        if r["status"] != "ok":
            label.set_color("tab:red")
    title = metric + (" (failed runs: no bar)" if any(r["status"] != "ok" for r in rows) else "")
    right.set(ylabel=metric, title=title)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)
    return bars


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
