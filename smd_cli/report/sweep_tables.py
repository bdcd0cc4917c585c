"""The tables and plots of a sweep (`smd ablate`): one row per run, and means over seeds.

Rows are plain dicts (`run`, the swept keys, `status`, `error`, the chosen summary metrics, `dir`); a failed
run is shown with its reason and never drawn as a 0; a collapsed run (`status` "collapsed", its reason in
`error`) is shown with its numbers, marked collapsed in every table and plot. The console tables name the metrics
by short labels (`label`: "evict after" for eval/evict/reward_after, the key in the caption) so that a 140-column terminal wraps
them between words; the CSVs and markdown keep the keys. The plots show both held-out evaluations, with a dense
KV cache and under eviction, after training (and before, as marks), with standard-error bars over the seeds.
Runs that ran different weights (`model.source=auto`: the Hub's checkpoint online, the dequantised GGUF offline)
are never averaged together: `weights_key` makes the weights a key of the tables, named in every row.
Library code: no Hydra.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from smd_cli.report.figures import pyplot
from smd_cli.report.stats import plus_minus
from smd_cli.report.tables import markdown
from smd_cli.runtime import records
from smd_cli.runtime.integrity import atomic_text, write_file

console = Console(width=None if sys.stdout.isatty() else 140)
LABELS = {  # summary key -> its short name in the console tables
    "eval/reward_before": "dense before", "eval/reward_after": "dense after",
    "eval/evict/reward_before": "evict before", "eval/evict/reward_after": "evict after",
    "eval/greedy_reward_before": "greedy dense before", "eval/greedy_reward_after": "greedy dense after",
    "eval/evict/greedy_reward_before": "greedy evict before", "eval/evict/greedy_reward_after": "greedy evict after",
    "eval/evict/kept_before": "answer KV kept before", "eval/evict/kept_after": "answer KV kept after",
    "last/mismatch/max_abs_diff": "last mismatch", "last/kv/kept_fraction": "KV kept", "train/seconds": "train seconds",
}
HELD_OUT = {"dense cache": "eval/reward", "under eviction": "eval/evict/reward"}  # + _after / _before: the two evaluations


def label(metric: str) -> str:
    """The console's short name of a summary key (words that wrap whole), e.g. eval/evict/reward_after -> evict after."""
    return LABELS.get(metric) or metric.removeprefix("eval/").replace("/", " ").replace("_", " ")


def _caption(metrics: list[str]) -> str:
    return "; ".join(f"{label(m)} = {m}" for m in metrics if label(m) != m)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def weights_key(rows: list[dict]) -> list[str]:
    """["weights"] when the rows' runs with results ran different weights (their summary.json's `model/weights`, else
    provenance.json's), each row then holding its own under `weights` (None: a failed run): a key of the tables like a
    swept one, so that no mean pools two models and every row names its weights. [] (rows unchanged) when they agree."""
    found = {id(r): _weights(Path(r["dir"])) if r["status"] in ("ok", "collapsed") else None for r in rows}
    labels = sorted({w for w in found.values() if w})
    if len(labels) < 2:
        return []
    for r in rows:
        r["weights"] = found[id(r)]
    console.print(f"[red]ablate: the runs ran {len(labels)} different weights[/red] (model.source=auto takes the Hub's checkpoint "
                  f"when it is reachable or cached, else the dequantised GGUF): {escape('; '.join(labels))}. The tables name each run's "
                  "(column weights) and average only runs of the same weights; set model.source=hub or gguf to run one model.",
                  highlight=False)
    return ["weights"]


def _weights(run_dir: Path) -> str | None:
    """The label of the weights a run ran, from its summary.json or provenance.json (None: neither says)."""
    for name, read in (("summary.json", lambda d: d.get("model/weights")),
                       ("provenance.json", lambda d: (d.get("weights") or {}).get("label"))):
        try:
            value = read(records.read_object(run_dir / name, missing_ok=True))
        except (OSError, records.Damaged, AttributeError):
            continue
        if value:
            return str(value)
    return None


def write_table(out: Path, rows: list[dict], keys: list[str], metrics: list[str]) -> None:
    """The rich table, ablation.md and ablation.csv; the `error` column when a run failed (always in the csv)."""
    columns = keys + metrics + ["status"] + (["error"] if any(r.get("error") for r in rows) else [])
    table = Table(title="smd ablate", caption=_caption(metrics))
    for c in columns:
        table.add_column(label(c) if c in metrics else c, justify="left" if c == "error" else "right", overflow="fold")
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns], style="red" if r["status"] != "ok" else None)
    console.print(table)
    write_file(out / "ablation.md", markdown(columns, [[_fmt(r.get(c)) for c in columns] for r in rows]))
    with atomic_text(out / "ablation.csv") as f:
        writer = csv.DictWriter(f, fieldnames=["run", *keys, *metrics, "status", "error", "dir"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_means(out: Path, groups: list[dict], keys: list[str], metrics: list[str], over: list[str], metric: str) -> dict:
    """`ablation_mean.md` / `.csv` (mean +- standard error over `over`, n finished of runs) and `ablation_mean.png`
    (both held-out evaluations after training, with their standard errors, and before as marks). Returns the bars
    drawn: (group label, key) -> (mean, standard error)."""
    plt = pyplot()
    columns = keys + metrics + ["n"]
    table = Table(title=f"smd ablate: mean ± standard error over {', '.join(over)}", caption=_caption(metrics))
    for c in columns:
        table.add_column(label(c) if c in metrics else c, justify="right")
    cells = [[str(g[k]) for k in keys] + [plus_minus(g.get(m), g.get(f"{m} se")) for m in metrics]
             + [f"{g['n']}/{g['runs']}" + (f" ({g['collapsed']} collapsed)" if g.get("collapsed") else "")] for g in groups]
    for c in cells:
        table.add_row(*c)
    console.print(table)
    write_file(out / "ablation_mean.md", f"Mean ± standard error over {', '.join(over)} (n finished / runs; a collapsed run "
                 "is counted and averaged in with its numbers).\n\n" + markdown(columns, cells))
    with atomic_text(out / "ablation_mean.csv") as f:
        fields = [*keys, *[c for m in metrics for c in (m, f"{m} se")], "n", "runs", "collapsed"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(groups)
    views = _views(metrics, metric)
    width, drawn = 0.8 / len(views), {}
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(groups) * len(views) + 2), 4))
    for j, (name, after, before) in enumerate(views):
        for i, g in enumerate(groups):
            x = i + (j - (len(views) - 1) / 2) * width
            if g.get(after) is None:
                ax.text(x, 0.03, "no run finished", transform=ax.get_xaxis_transform(), rotation=90, ha="center", color="tab:red",
                        fontsize=8)
                continue
            bar = ax.bar(x, g[after], width, yerr=g.get(f"{after} se") or 0.0, capsize=3, color=VIEW_COLORS[j % len(VIEW_COLORS)],
                         label=f"{name}, after" if i == 0 else None)
            ax.bar_label(bar, [f"{g[after]:.3g}"], fontsize=7, label_type="center", color="white")
            drawn[(",".join(f"{k}={g[k]}" for k in keys), after)] = (g[after], g.get(f"{after} se"))
            if before and g.get(before) is not None:
                ax.errorbar(x, g[before], yerr=g.get(f"{before} se") or 0.0, fmt="_", color="black", markersize=12, capsize=2,
                            label="before training" if i == 0 and j == 0 else None)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xticks(range(len(groups)), [",".join(f"{k}={g[k]}" for k in keys) + f" (n={g['n']})" for g in groups], rotation=20,
                  ha="right", fontsize=8)
    ax.set_ylabel("held-out reward")
    ax.set_ylim(0, 1.25 * max([1e-9, *(m + (se or 0.0) for m, se in drawn.values())]))
    ax.legend(fontsize=8, loc="upper right", ncols=3)
    ax.set_title(f"held-out reward, {' and '.join(v[0] for v in views)}: mean ± standard error over {', '.join(over)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ablation_mean.png", dpi=120)
    plt.close(fig)
    return drawn


VIEW_COLORS = ("tab:blue", "tab:orange")


def _views(metrics: list[str], metric: str) -> list[tuple[str, str, str | None]]:
    """(name, after key, before key or None) of the held-out evaluations among `metrics`, both views when there;
    else `metric` alone."""
    found = [(name, f"{p}_after", f"{p}_before" if f"{p}_before" in metrics else None) for name, p in HELD_OUT.items()
             if f"{p}_after" in metrics]
    return found or [(label(metric), metric, None)]


def write_plot(out: Path, rows: list[dict], metric: str) -> dict[str, float]:
    """ablation.png. Left: training reward per step for each run (a failed run's partial curve dashed); right:
    the held-out reward after training per run, with a dense cache and under eviction side by side (`metric` alone
    when the rows have neither), a bar for each that finished with a number, a red "failed" (or grey "n/a") mark in
    place of the bars otherwise, never a 0. Returns the bars of `metric` drawn, run -> height."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        path = Path(r["dir"]) / "metrics.jsonl"
        if path.is_file():
            try:
                steps = records.read_metrics(path, torn_tail_ok=True)  # a run killed mid-line: its steps before
            except (OSError, records.Damaged) as err:  # named, never drawn
                console.print(f"[yellow]note:[/yellow] {escape(str(err))}: its training curve is left out", highlight=False)
                continue
            failed = r["status"] not in ("ok", "collapsed")
            left.plot([s.get("step") for s in steps], [s.get("reward") for s in steps], linestyle="--" if failed else "-",
                      label=r["run"] + (" (failed)" if failed else " (collapsed)" if r["status"] == "collapsed" else ""))
    left.set(xlabel="step", ylabel="training reward", title="reward during training")
    if left.lines and len(left.lines) <= 12:
        left.legend(fontsize=8)
    bars: dict[str, float] = {}
    marks = right.get_xaxis_transform()  # x in data units, y in axes fraction
    views = _views(list(rows[0]) if rows else [], metric)
    width, named = 0.8 / len(views), set()
    for i, r in enumerate(rows):
        ok = r["status"] in ("ok", "collapsed")  # a collapsed run's numbers are what its policy does: drawn, hatched
        fallen = r["status"] == "collapsed"
        for j, (name, after, _) in enumerate(views):
            value = r.get(after)
            if ok and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                bar = right.bar(i + (j - (len(views) - 1) / 2) * width, value, width, color=VIEW_COLORS[j % len(VIEW_COLORS)],
                                hatch="//" if fallen else None, edgecolor="tab:red" if fallen else None,
                                label=None if name in named else name)
                named.add(name)
                right.bar_label(bar, fmt="%.3g", fontsize=7)  # a real 0 reads "0"
                if after == metric or len(views) == 1:
                    bars[r["run"]] = float(value)
        if not ok or not any(isinstance(r.get(after), (int, float)) for _, after, _ in views):
            right.text(i, 0.03, "failed" if not ok else "n/a", transform=marks, rotation=90, ha="center", va="bottom",
                       color="tab:red" if not ok else "grey", fontsize=9, fontweight="bold" if not ok else "normal")
        elif fallen:
            right.text(i, 0.97, "collapsed", transform=marks, ha="center", va="top", color="tab:red", fontsize=8, fontweight="bold")
    right.set_xlim(-0.6, len(rows) - 0.4)
    right.set_xticks(range(len(rows)), [r["run"] for r in rows], rotation=20 if len(rows) <= 12 else 90, ha="right", fontsize=8)
    for tick, r in zip(right.get_xticklabels(), rows):
        if r["status"] != "ok":
            tick.set_color("tab:red")
    title = "held-out reward after training" + (" (failed runs: no bar)" if any(r["status"] not in ("ok", "collapsed") for r in rows) else "")
    title += " (hatched: collapsed)" if any(r["status"] == "collapsed" for r in rows) else ""
    right.set(ylabel=" / ".join(label(after) for _, after, _ in views), title=title)
    if len(views) > 1 and right.containers:
        right.set_ylim(0, 1.25 * max([1e-9, *(r.get(a) for r in rows for _, a, _ in views if isinstance(r.get(a), (int, float)))]))
        right.legend(fontsize=8, loc="upper right", ncols=2)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)
    return bars
