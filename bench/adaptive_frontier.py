"""compression=adaptive against fixed compressions: the memory / reward frontier of a finished sweep (issue 29 item 4).

Usage: python bench/adaptive_frontier.py RUNS_DIR [--md out.md] [--csv out.csv] [--png out.png]
RUNS_DIR holds the member runs of
  smd ablate scale=small algo=smd,naive_sparse compression=adaptive,0.3,0.5,0.7 seed=0,1,2 hydra/launcher=joblib hydra.launcher.n_jobs=2
(each with config.json and summary.json). Per algorithm and compression, over the seeds: the KV the rollouts kept
(the mean over steps of `kv/kept_fraction`: memory), the compression the run chose (adaptive) or was given, the 5th
percentile and the mean of per-token agreement (means over steps), and the held-out reward after training, under the run's own
evicting cache and with a dense cache (greedy, 16 prompts). A cell is dominated when a fixed cell of the same
algorithm keeps no more KV and ends at least as high under its own cache.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from smd_cli.runtime.integrity import atomic_text, write_file

FIELDS = {"kv kept": "train/kv/kept_fraction_mean", "compression chosen": "train/compression_mean",
          "agreement p5": "train/agreement/p5_mean", "agreement mean": "train/agreement/mean_mean", "held-out, own cache": "eval/evict/reward_after",
          "held-out, dense cache": "eval/reward_after", "before, own cache": "eval/evict/reward_before"}


def load(runs: Path) -> list[dict]:
    rows = []
    for summary_path in sorted(runs.glob("*/summary.json")):
        summary = json.loads(summary_path.read_text())
        config = json.loads((summary_path.parent / "config.json").read_text())
        if summary.get("status") not in ("completed", "collapsed"):
            continue
        rows.append({"algo": config["algo"]["name"], "compression": str(config["compression"]), "seed": config["seed"],
                     "status": summary["status"], **{k: summary.get(v) for k, v in FIELDS.items()}})
    return rows


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def cells(rows: list[dict]) -> list[dict]:
    out = []
    for algo in sorted({r["algo"] for r in rows}):
        for c in sorted({r["compression"] for r in rows if r["algo"] == algo}, key=lambda c: (c != "adaptive", c)):
            group = [r for r in rows if r["algo"] == algo and r["compression"] == c]
            cell = {"algo": algo, "compression": c, "seeds": len(group)}
            for k in FIELDS:
                cell[k], cell[k + " se"] = mean_se([r[k] for r in group])
            out.append(cell)
    for cell in out:
        rivals = [o for o in out if o["algo"] == cell["algo"] and o["compression"] != "adaptive" and o is not cell]
        cell["dominated by"] = ", ".join(o["compression"] for o in rivals
                                         if o["kv kept"] <= cell["kv kept"] and o["held-out, own cache"] >= cell["held-out, own cache"]) or "-"
    return out


def paired(rows: list[dict], algo: str, a: str, b: str, key: str) -> tuple[float, float, int]:
    """Mean and standard error over seeds of (cell a - cell b) for `key`."""
    by = {(r["compression"], r["seed"]): r[key] for r in rows if r["algo"] == algo}
    diffs = [by[(a, s)] - by[(b, s)] for s in sorted({s for c, s in by if c == a}) if (b, s) in by]
    m, se = mean_se(diffs) if diffs else (float("nan"), float("nan"))
    return m, se, len(diffs)


def markdown(table: list[dict], rows: list[dict]) -> str:
    head = ["algo", "compression", "seeds", *FIELDS, "dominated by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in table:
        values = [c["algo"], c["compression"], str(c["seeds"])]
        values += [f"{c[k]:.3f} ± {c[k + ' se']:.3f}" for k in FIELDS]
        lines.append("| " + " | ".join(values + [c["dominated by"]]) + " |")
    lines.append("")
    for algo in sorted({r["algo"] for r in rows}):
        for key in ("held-out, own cache", "held-out, dense cache", "kv kept"):
            m, se, n = paired(rows, algo, "adaptive", "0.3", key)
            lines.append(f"- {algo}, adaptive - fixed 0.3, {key}: {m:+.3f} ± {se:.3f} (paired over {n} seeds)")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for algo, colour in zip(sorted({c["algo"] for c in table}), ("tab:blue", "tab:orange", "tab:green")):
        fixed = sorted((c for c in table if c["algo"] == algo and c["compression"] != "adaptive"), key=lambda c: c["kv kept"])
        ax.errorbar([c["kv kept"] for c in fixed], [c["held-out, own cache"] for c in fixed],
                    yerr=[c["held-out, own cache se"] for c in fixed], color=colour, marker="o", label=f"{algo}, fixed")
        for c in fixed:
            ax.annotate(f"c={c['compression']}", (c["kv kept"], c["held-out, own cache"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        for c in (c for c in table if c["algo"] == algo and c["compression"] == "adaptive"):
            ax.errorbar([c["kv kept"]], [c["held-out, own cache"]], xerr=[c["kv kept se"]], yerr=[c["held-out, own cache se"]],
                        color=colour, marker="*", markersize=14, linestyle="none", label=f"{algo}, adaptive")
    ax.set_xlabel("KV kept by the rollouts (fraction, mean over steps)")
    ax.set_ylabel("held-out reward after training, own cache")
    ax.set_title("compression=adaptive against fixed budgets (SmolLM2 passkey, 3 seeds)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    rows = load(args.runs)
    if not rows:
        raise SystemExit(f"no finished runs under {args.runs}")
    table = cells(rows)
    text = markdown(table, rows)
    print(text)
    if args.md:
        write_file(args.md, text)
    if args.csv:
        with atomic_text(args.csv) as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.png:
        plot(table, args.png)


if __name__ == "__main__":
    main()
