"""The RULER table and plot from `bench/ruler_grid.py`'s JSON: a row per (family, length), a column per policy (RULER's
string_match_all, mean +- standard error over prompts, and the answer-bearing KV kept), and a bar plot a panel per
family.

Usage: python bench/ruler_report.py GRID.json [GRID.json ...] --md OUT.md --png OUT.png [--lines OUT.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smd_cli.tasks.base import mean, stderr  # noqa: E402


def cells(paths: list[Path]) -> list[dict]:
    return [cell for path in paths for cell in json.loads(path.read_text())]


def label(cell: dict) -> str:
    return f"{cell['family']}" + (f" ({cell['haystack']})" if cell.get("haystack") else "")


def merged(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(family label, tokens) -> policy@compression -> its result with its cell's n; where two cells hold the same
    point, the one with more prompts (every cell evaluates the test examples 0..n-1, so smaller cells are prefixes)."""
    out: dict[tuple, dict[str, dict]] = {}
    for cell in rows:
        points = out.setdefault((label(cell), cell["prompt_tokens"]), {})
        for name, r in cell["results"].items():
            if name not in points or points[name]["n"] < cell["n"]:
                points[name] = {**r, "n": cell["n"]}
    return out


def _paired(a: list[float], b: list[float]) -> str:
    """Mean ± standard error of a - b over the prompts both hold (the first min(len) test examples)."""
    d = [x - y for x, y in zip(a, b)]
    return f"{mean(d):+.3f} ± {stderr(d):.3f}"


def table(rows: list[dict]) -> str:
    """A row per (family, length, policy), a column per compression; the dense score beside, and the paired loss of
    each policy at 0.5 against dense on the same prompts."""
    grid = merged(rows)
    compressions = sorted({float(name.partition("@")[2]) for points in grid.values() for name in points if "@" in name})
    out = ["| family | tokens | dense | policy | " + " | ".join(f"c = {c}" for c in compressions) + " | dense - policy@0.5 (paired) |",
           "|" + "---|" * (5 + len(compressions))]
    for (name, tokens), points in grid.items():
        dense = points.get("dense")
        shown = f"{dense['summary']['ruler']:.3f} ± {dense['summary']['ruler_stderr']:.3f} (n {dense['n']})" if dense else ""
        for policy in dict.fromkeys(n.partition("@")[0] for n in points if n != "dense"):
            parts = []
            for c in compressions:
                r = points.get(f"{policy}@{c}")
                if r is None:
                    parts.append("")
                    continue
                s, kept = r["summary"], r["summary"].get("evidence/kept")
                parts.append(f"{s['ruler']:.3f} ± {s['ruler_stderr']:.3f}" + ("" if kept is None else f" (kept {kept:.2f})")
                             + ("" if dense and r["n"] == dense["n"] else f" n {r['n']}"))
            half = points.get(f"{policy}@0.5")
            gap = _paired(dense["scores"], half["scores"]) if dense and half else ""
            out.append(f"| {name} | {tokens} | {shown} | {policy} | " + " | ".join(parts) + f" | {gap} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2), sharey=True, squeeze=False)
    for ax, cell in zip(axes[0], rows):
        names = list(cell["results"])
        means = [cell["results"][n]["summary"]["ruler"] for n in names]
        errors = [cell["results"][n]["summary"]["ruler_stderr"] for n in names]
        ax.bar(range(len(names)), means, yerr=errors, color=["0.3"] + ["C0", "C1", "C2", "C3", "C4"][: len(names) - 1], capsize=3)
        ax.set_xticks(range(len(names)), [n.replace("@", "\n@") for n in names], fontsize=8)
        ax.set_title(f"{label(cell)}\n{cell['prompt_tokens']} tokens, n={cell['n']}", fontsize=9)
        ax.set_ylim(0, 1)
        ax.axhspan(0.3, 0.85, color="0.9", zorder=0)
    axes[0][0].set_ylabel("RULER string_match_all (greedy)")
    fig.suptitle("SmolLM2-135M-Instruct (dequantised Q4_1) on RULER families; grey band: the calibration window 0.3-0.85", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_compression(rows: list[dict], path: Path) -> None:
    """Score against compression, a line per policy, a panel per (family, length) with more than one compression;
    cells of one family merged (their n in the legend when they differ)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, dict[str, dict[float, tuple[float, float, int]]]] = {}
    for cell in rows:
        lines = panels.setdefault((label(cell), cell["prompt_tokens"]), {})
        for name, r in cell["results"].items():
            policy, _, c = name.partition("@")
            s = r["summary"]
            points = lines.setdefault(policy, {})
            x = float(c or 0.0)
            if x not in points or points[x][2] < cell["n"]:  # the larger sample where two cells share a point
                points[x] = (s["ruler"], s["ruler_stderr"], cell["n"])
    panels = {k: v for k, v in panels.items() if any(len(p) > 1 for name, p in v.items() if name != "dense")}
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.3), sharey=True, squeeze=False)
    for ax, ((name, tokens), lines) in zip(axes[0], panels.items()):
        dense = lines.pop("dense", {})
        if dense:
            mean = sum(v[0] for v in dense.values()) / len(dense)
            ax.axhline(mean, color="0.3", ls="--", label=f"dense (n {max(v[2] for v in dense.values())})")
        for policy, points in lines.items():
            xs = sorted(points)
            ax.errorbar(xs, [points[x][0] for x in xs], yerr=[points[x][1] for x in xs], marker="o", capsize=3,
                        label=policy + ("" if len({points[x][2] for x in xs}) == 1 else " (n " + "/".join(str(points[x][2]) for x in xs) + ")"))
        ax.set_title(f"{name}, {tokens} tokens", fontsize=9)
        ax.set_xlabel("compression (fraction of prompt KV evicted)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("RULER string_match_all (greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("grids", type=Path, nargs="+")
    parser.add_argument("--md", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--lines", type=Path, help="score against compression, a line per policy (cells with several compressions)")
    args = parser.parse_args(argv)
    rows = cells(args.grids)
    text = table(rows)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.png:
        plot(rows, args.png)
    if args.lines:
        plot_compression(rows, args.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
