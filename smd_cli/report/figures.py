"""The report's figures: curves over training steps (mean and a standard-error band over seeds), and the
ablations as lines or bars with standard-error bars. Each writes one PNG and returns its path."""

from __future__ import annotations

import math
from pathlib import Path

from smd_cli.report.claims import VIEWS
from smd_cli.report.data import Sweep
from smd_cli.report.stats import cell

COLORS = {"dense": "tab:gray", "naive_sparse": "tab:red", "sparse_rl": "tab:orange", "tis": "tab:purple", "mis": "tab:brown",
          "icepop": "tab:pink", "trm": "tab:olive", "smd": "tab:blue"}


def pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display), imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, axes, title: str, path: Path) -> Path:
    """Legends where something is drawn, the title, and the PNG at `path`."""
    for ax in axes:
        if ax.lines or ax.containers or ax.collections:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(ax, runs, key, label, color, log=False):
    """Mean over runs of per-step `key` with a +-1 standard-error band; steps where no run logged it are skipped."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for row in run.steps():
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                by_step.setdefault(row["step"], []).append(max(value, 1e-9) if log else value)
    if not by_step:
        return
    steps = sorted(by_step)
    cells = [cell(by_step[s]) for s in steps]
    mean = [c.mean for c in cells]
    se = [c.se or 0.0 for c in cells]
    ax.plot(steps, mean, label=f"{label} (n={max(c.n for c in cells)})", color=color)
    ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], color=color, alpha=0.2)


def training_curves(sweep: Sweep, task: str | None, out: Path) -> Path:
    """Per algorithm: the sampler's training reward, the learner's mismatch with the sampler, a dense learner's, and the
    5th percentile of the sampler's per-token agreement with the dense policy (`smd_cli.learner.agreement`; runs that log it)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    t = {"task": task} if task else {}
    for algo in sweep.values("algo"):
        runs = [r for r in sweep.select(**t, algo=algo) if r.ok]
        color = COLORS.get(algo)
        _band(axes[0], runs, "reward", algo, color)
        _band(axes[1], runs, "mismatch/mean_abs_diff", algo, color, log=True)
        _band(axes[2], runs, "mismatch/dense_mean_abs_diff", algo, color, log=True)
        _band(axes[3], runs, "agreement/p5", algo, color)
    axes[0].set(xlabel="step", ylabel="reward", title="training reward (the sampler's, under its eviction)")
    axes[1].set(xlabel="step", ylabel="mean |log p - log p_sampler|", yscale="log",
                title="the learner's own view vs the sampler")
    axes[2].set(xlabel="step", ylabel="mean |log p_dense - log p_sampler|", yscale="log", title="a dense learner vs the sampler")
    axes[3].set(xlabel="step", ylabel="p5 of sum_v min(p_dense, p_sampler)", title="agreement with the dense policy, 5th percentile")
    return _finish(plt, fig, axes, f"{task or 'main table'}: mean and standard-error band over seeds", out / f"curves_{task or 'main'}.png")


def evidence_curves(sweep: Sweep, task: str | None, layers: int, out: Path) -> Path | None:
    """Per layer: the fraction of answer-bearing KV entries the sampler's eviction kept, per step and algorithm."""
    t = {"task": task} if task else {}
    if not any("evidence/kept_l0" in row for r in sweep.select(**t) if r.ok for row in r.steps()[:1]):
        return None
    plt = pyplot()
    cols = min(layers, 6)  # a grid, not one row: SmolLM2's 30 layers in a row were 16500 pixels wide
    rows = -(-layers // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharex=True, sharey=True)
    axes = list(grid.flat)
    for algo in sweep.values("algo"):
        runs = [r for r in sweep.select(**t, algo=algo) if r.ok]
        for layer in range(layers):
            _band(axes[layer], runs, f"evidence/kept_l{layer}", algo, COLORS.get(algo))
    for layer, ax in enumerate(axes):
        if layer < layers:
            ax.set(title=f"layer {layer}", ylim=(0, 1.02))
        else:  # the grid's last row, past the last layer
            ax.set_visible(False)
    for ax in grid[-1]:
        ax.set(xlabel="step")
    for ax in grid[:, 0]:
        ax.set(ylabel="answer KV kept")
    return _finish(plt, fig, axes[:1], f"{task or 'main table'}: answer-bearing KV entries kept by the sampler's eviction (mean and "
                   "standard-error band over seeds; the legend in layer 0)", out / f"evidence_{task or 'main'}.png")


def ablation_lines(sweep: Sweep, x_key: str, out: Path, name: str) -> Path:
    """The held-out metric (both views) against a swept number, one line per algorithm (or one line)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(VIEWS), figsize=(6 * len(VIEWS), 4))
    xs = sweep.values(x_key)
    series = sweep.values("algo") if "algo" in sweep.keys else [None]
    for ax, (view, metric) in zip(axes, VIEWS.items()):
        for algo in series:
            a = {"algo": algo} if algo else {}
            cells = [sweep.cell(metric, **a, **{x_key: x}) for x in xs]
            pts = [(float(x), c) for x, c in zip(xs, cells) if c.mean is not None]
            if pts:
                ax.errorbar([p for p, _ in pts], [c.mean for _, c in pts], yerr=[c.se or 0.0 for _, c in pts], marker="o", capsize=3,
                            label=algo or "smd", color=COLORS.get(algo or "smd"))
        ax.set(xlabel=x_key, ylabel=metric, title=f"held-out, {view}")
    return _finish(plt, fig, axes, f"{name}: mean ± standard error over seeds", out / f"{name}.png")


def ablation_bars(sweep: Sweep, x_key: str, out: Path, name: str) -> Path:
    """The held-out metric (both views) per value of a swept option, grouped bars per algorithm."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(VIEWS), figsize=(6 * len(VIEWS), 4))
    xs, algos = sweep.values(x_key), sweep.values("algo")
    width = 0.8 / max(len(algos), 1)
    for ax, (view, metric) in zip(axes, VIEWS.items()):
        for i, algo in enumerate(algos):
            cells = [sweep.cell(metric, algo=algo, **{x_key: x}) for x in xs]
            positions = [j + (i - (len(algos) - 1) / 2) * width for j in range(len(xs))]
            ax.bar(positions, [c.mean or 0.0 for c in cells], width, yerr=[c.se or 0.0 for c in cells], capsize=3, label=algo,
                   color=COLORS.get(algo))
        ax.set_xticks(range(len(xs)), xs)
        ax.set(xlabel=x_key, ylabel=metric, title=f"held-out, {view}")
    return _finish(plt, fig, axes, f"{name}: mean ± standard error over seeds", out / f"{name}.png")


def seeds_scatter(sweep: Sweep, task: str | None, out: Path) -> Path | None:
    """One point per run: the answer-bearing KV its seed's warm start kept under eviction (x) against its held-out reward
    under eviction after training (y), per algorithm; a collapsed run hollow. Where the warm start's eviction loses the
    evidence, no algorithm reaches a high reward."""
    t = {"task": task} if task else {}
    points = {a: [(r.summary.get("eval/evict/kept_before"), r.summary.get("eval/evict/reward_after"), r.collapsed)
                  for r in sweep.select(**t, algo=a) if r.ok] for a in sweep.values("algo")}
    points = {a: [p for p in ps if all(isinstance(v, (int, float)) for v in p[:2])] for a, ps in points.items()}
    if not any(points.values()):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for algo, ps in points.items():
        color = COLORS.get(algo)
        ax.scatter([p[0] for p in ps if not p[2]], [p[1] for p in ps if not p[2]], label=algo, color=color, alpha=0.8, s=25)
        if any(p[2] for p in ps):
            ax.scatter([p[0] for p in ps if p[2]], [p[1] for p in ps if p[2]], facecolors="none", edgecolors=color, s=40)
    ax.set(xlabel="warm start: answer-bearing KV kept under eviction", ylabel="held-out reward under eviction, after",
           xlim=(0, 1.02), ylim=(0, 1.02))
    return _finish(plt, fig, [ax], f"{task or 'main table'}: each seed's warm start against each algorithm's result (hollow: collapsed)",
                   out / f"seeds_{task or 'main'}.png")
