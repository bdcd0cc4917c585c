"""The report's tables over runs: the main table per task, each seed's warm start beside every algorithm's result, the
rollout corrections' verdicts against dense and SMD, and what each correction masked or reweighted.

Each function returns (header, rows) for `write.Report.table`, or sentences; numbers come from the runs only.
"""

from __future__ import annotations

import math

from smd_cli.report.claims import FIXED, GREATER, MARGIN, NOT_WORSE, PAPER_GSM8K, VIEWS, Finding
from smd_cli.report.data import Sweep
from smd_cli.report.stats import Cell, cell, plus_minus

MAIN_COLUMNS = [  # (header, metric)
    ("held-out, dense cache", "eval/reward_after"), ("held-out, under eviction", "eval/evict/reward_after"),
    ("greedy, dense cache", "eval/greedy_reward_after"), ("greedy, under eviction", "eval/evict/greedy_reward_after"),
    ("exact match, dense cache", "eval/exact_after"), ("exact match, under eviction", "eval/evict/exact_after"),
    ("training reward (last 10 steps)", "steps:reward:last10"), ("max learner mismatch", "train/mismatch/max_abs_diff_max"),
    ("answer KV kept, training", "train/evidence/kept_mean"), ("answer KV kept, held-out after", "eval/evict/kept_after"),
]
CORRECTION_PREFIXES = ("is/", "rollout_corr/", "correction/")  # per-step fractions a correction masked or reweighted


def markdown(columns: list[str], rows: list[list]) -> str:
    """A markdown table (cells with `|` or newlines escaped)."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]) + "\n"


COUNTS = ["n", "collapsed", "failed"]  # a cell's runs: with results (collapsed ones included), collapsed, failed


def counts(runs) -> list[int]:
    """A cell's runs with results, how many of them collapsed, and how many failed (ran, no results)."""
    runs = list(runs)
    return [sum(r.ok for r in runs), sum(r.ok and r.collapsed for r in runs), sum(r.failed for r in runs)]


def main_rows(sweep: Sweep, t: dict) -> tuple[list[str], list[list]]:
    """The main table of one task: the warm start, then each algorithm (mean ± se over seeds)."""
    first = sweep.values("algo")[0]  # the warm start and its evaluations are the same for every algorithm of a seed
    before = [sweep.cell(m.removesuffix("_after") + "_before", **t, algo=first) if m.endswith("_after") else None for _, m in MAIN_COLUMNS]
    rows = [["before training (warm start)", max(c.n for c in before if c is not None), "", "",
             *("" if c is None else str(c) for c in before), ""]]
    for algo in sweep.values("algo"):
        cells = [sweep.cell(m, **t, algo=algo) for _, m in MAIN_COLUMNS]
        rows.append([algo, *counts(sweep.select(**t, algo=algo)), *map(str, cells), PAPER_GSM8K.get(algo, "-")])
    return ["algo", *COUNTS, *(h for h, _ in MAIN_COLUMNS), "paper (GSM8K %)"], rows


def per_seed(sweep: Sweep, t: dict) -> tuple[list[str], list[list], list[str]]:
    """Each seed's warm start (held-out under eviction, answer KV kept) beside each algorithm's held-out reward under
    eviction after training (and the answer KV its eviction kept); † marks a collapsed run, "failed" a failed one (the
    verdicts count it as 0). Then sentences that
    say how much of the spread is the seed's and how much the algorithm's."""
    algos = sweep.values("algo")
    header = ["seed", "warm start: under eviction", "warm start: answer KV kept", *algos, "mean over algorithms"]
    rows, means, kept, spreads = [], [], [], []
    for seed in sweep.seeds():
        runs = {a: next((r for r in sweep.select(**t, algo=a, seed=seed) if r.ok), None) for a in algos}
        lost = {a for a in algos if sweep.failures(**t, algo=a, seed=seed)}
        warm = next((r for r in runs.values() if r is not None), None)
        if warm is None:
            continue
        after = {a: r.summary.get("eval/evict/reward_after") for a, r in runs.items() if r is not None}
        values = [v for v in after.values() if isinstance(v, (int, float))]

        def show(a):
            r = runs[a]
            if r is None or not isinstance(after.get(a), (int, float)):
                return "failed" if a in lost else "-"
            k = r.summary.get("eval/evict/kept_after")
            return f"{after[a]:.3f}" + ("" if k is None else f" ({k:.2f})") + (" †" if r.collapsed else "")

        mean = sum(values) / len(values) if values else None
        rows.append([seed, warm.summary.get("eval/evict/reward_before"), warm.summary.get("eval/evict/kept_before"),
                     *map(show, algos), mean])
        if mean is not None and isinstance(warm.summary.get("eval/evict/kept_before"), (int, float)):
            means.append(mean)
            kept.append(warm.summary["eval/evict/kept_before"])
            spreads.append(max(values) - min(values))
    notes = []
    if len(means) >= 3:
        r = correlation(kept, means)
        notes.append(f"Over {len(means)} seeds, the warm start's answer KV kept under eviction and the algorithms' mean held-out "
                     f"reward under eviction after training correlate with r = {r:+.2f}." if r is not None else "")
        notes.append(f"The seeds' means spread from {min(means):.3f} to {max(means):.3f} (standard deviation {cell(means).se * math.sqrt(len(means)):.3f}); "
                     f"within a seed the algorithms differ by {sum(spreads) / len(spreads):.3f} on average (largest minus smallest).")
    return header, rows, [n for n in notes if n]


def correlation(xs: list[float], ys: list[float]) -> float | None:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def correction_fractions(sweep: Sweep, t: dict) -> tuple[list[str], list[list]]:
    """Per algorithm, the mean per step of every fraction its correction reports (tokens or sequences masked,
    rejected, truncated), mean ± se over seeds."""
    rows = []
    for algo in sweep.values("algo"):
        runs = [r for r in sweep.select(**t, algo=algo) if r.ok and r.steps()]
        keys = sorted({k for r in runs for k in r.steps()[0] if k.startswith(CORRECTION_PREFIXES) and k.endswith("_frac")})
        rows += [[algo, key, str(cell(r.metric(f"steps:{key}:mean") for r in runs))] for key in keys]
    return ["algo", "per-step fraction", "mean ± se over seeds"], rows


def verdict_cell(f: Finding | None) -> str:
    if f is None:
        return "-"
    d = f.decision.d if f.decision is not None else Cell(None, None, 0)
    fixed = "; fixed prompts" if f.prompts == FIXED else ""
    diff = "" if d.mean is None else f" ({plus_minus(d.mean, d.se, signed=True)}, {d.n} seeds{fixed})"
    return f"**{f.verdict}**{diff}"


def corrections(findings: list[Finding], sweep: Sweep) -> dict[str, tuple[list[str], list[list]]]:
    """Two tables: each evicting algorithm against dense (does it recover the dense learner's result, within the
    margin) and SMD against each, per task and view: verdict (paired difference ± se, seeds)."""
    tasks = sweep.values("task") if "task" in sweep.keys else [""]
    to_dense = {(f.scope, f.view, f.pair[0]): f for f in findings if f.pair[1] == "dense" and f.rule == NOT_WORSE}
    to_smd = {(f.scope, f.view, f.pair[1]): f for f in findings if f.pair[0] == "smd" and f.pair[1] != "dense" and f.rule == GREATER}
    columns = [f"{'task ' + task + ', ' if task else ''}{view}" for task in tasks for view in VIEWS]
    scopes = [(f"task {task}" if task else "main table", view) for task in tasks for view in VIEWS]
    algos = [a for a in sweep.values("algo") if a != "dense"]
    against_dense = [[a, *(verdict_cell(to_dense.get((s, v, a))) for s, v in scopes)] for a in algos]
    against_smd = [[a, *(verdict_cell(to_smd.get((s, v, a))) for s, v in scopes)] for a in algos if a != "smd"]
    return {"recover_dense": (["algo: matches dense within " + str(MARGIN), *columns], against_dense),
            "smd_against": (["SMD > algo", *columns], against_smd)}


def recover_sentences(findings: list[Finding]) -> list[str]:
    """Per task and view: which algorithms recover the dense learner's result (holds), which do not, which are undecided."""
    lines = []
    groups: dict[tuple, dict[str, list[str]]] = {}
    for f in findings:
        if f.pair[1] == "dense" and f.rule == NOT_WORSE:
            groups.setdefault((f.scope, f.view), {}).setdefault(f.verdict, []).append(f.pair[0])
    for (scope, view), verdicts in groups.items():
        labels = (("holds", "recover"), ("does not hold", "do not"), ("inconclusive", "undecided"),
                  ("uninformative (ceiling)", "at the ceiling"), ("uninformative (floor)", "at the floor"))
        parts = [f"{label}: {', '.join(verdicts[v])}" for v, label in labels if verdicts.get(v)]
        lines.append(f"{scope}, {view}: " + "; ".join(parts))
    return lines
