"""The paper's claims on the trained policies, each with the rule that turns the runs into a verdict.

Every verdict is computed here from the sweeps, never typed: two cells (an algorithm on a task, an ablation's
value) are compared seed by seed (`Sweep.paired`: a seed's runs share their warm start, prompts and sampling)
and judged by `smd_cli.report.stats.sequential`, the t test on the paired differences looked at as seeds come in
(`holds` / `does not hold` / `inconclusive`, with the detectable difference when it stays inconclusive at the
cap). The verdict knows the metric (`measure`): a held-out reward in [0, 1] averaged over the runs' held-out
prompts (`eval.num_prompts` of each run's config.json), so its standard error is never below what one prompt's
worth allows, and a comparison whose runs all sit at the reward's ceiling (or floor) says "uninformative
(ceiling)" instead of a verdict (`smd_cli/report/stats.py`'s docstring: why). Every seed that ran is in the comparison: a
failed run (diverged, parity broken, stopped by an error) counts as the reward's worst value, 0, so that an algorithm
is never flattered by the seeds it lost, and the evidence names it. A verdict is about the task's prompts when every
run it rests on evaluated its seed's own held-out prompts (`eval.prompts=per_seed`, `smd_cli.evaluation.heldout`); where any
evaluated the fixed prompts every seed shares (every run recorded before that key), the verdict is about those N
prompts, and the evidence and `Finding.prompts` say so. A claim is judged twice, once per way of
evaluating the policies on the held-out split: with a dense KV cache, and under the run's eviction (a dense-trained
policy under SnapKV at the same compression), since the paper's tables do not say which one they use and SMD
optimises the second.

The main table's claims are generic over the algorithms its sweep holds: the paper's (SMD near-lossless against
dense, SMD beats Sparse-RL and naive compression, naive falls behind dense) and, for every other rollout
correction present (tis, mis, icepop, trm, ...), the same paired verdicts against SMD and against dense
(`group` "corrections"), so a correction added to `recipes/main_table.yaml` is judged as soon as its runs exist.

The paper's numbers are from `../shared/REFERENCES.md` section 1 (the paper's body is not public).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from smd_cli.evaluation.heldout import draw_of
from smd_cli.report.data import Sweep
from smd_cli.report.stats import (
    CEILING,
    FAILS,
    FLOOR,
    HOLDS,
    INCONCLUSIVE,
    Cell,
    Decision,
    Measure,
    Sequential,
    number,
    plus_minus,
    sequential,
)
from smd_cli.runtime import records

MARGIN = 0.05  # "matches" / "robust": not worse by more than 0.05 of the metric (fixed before any run)
VIEWS = {"dense cache": "eval/reward_after", "under eviction": "eval/evict/reward_after"}
PAPER_GSM8K = {"dense": 74.5, "smd": 73.6, "sparse_rl": 71.2, "naive_sparse": 64.3}  # accuracy %, Qwen3-4B, 50 % compression
NAMES = {"smd": "SMD", "dense": "dense", "naive_sparse": "naive compression", "sparse_rl": "Sparse-RL", "tis": "TIS", "mis": "MIS",
         "icepop": "IcePop", "trm": "TRM"}
NOT_MEASURED = "not measured"

UNINFORMATIVE = (CEILING, FLOOR)
GREATER = ("a > b: holds if t = d / se > c, does not hold if t < -c (d: mean of the per-seed a - b; c: the look's critical value; "
           "se at least one held-out prompt's worth; every run at the reward's bound: uninformative; a failed run counts as 0)")
NOT_WORSE = (f"a matches b: holds if t = (d + {MARGIN}) / se >= c, does not hold if t < -c (a worse than b by more than {MARGIN}; "
             f"c: the look's critical value; se at least sqrt({MARGIN} / N) / sqrt(n) over N held-out prompts; every run at the "
             "reward's bound: uninformative; a failed run counts as 0)")
PER_SEED, FIXED = "per seed", "fixed"  # Finding.prompts: each seed its own held-out prompts (about the task), or the same for all
NOT_THE_TASK = "not the task: "  # ends the words that say a verdict is about fixed prompts (`about`)


@dataclass
class Finding:
    claim: str  # the paper's claim
    paper: str  # what the paper reports
    rule: str  # how the verdict follows from the data
    scope: str  # where it was tested (task, size, values compared)
    evidence: str  # the numbers it rests on
    verdict: str
    view: str | None = None  # the held-out evaluation (a key of VIEWS) for claims on the trained policies
    decision: Decision | None = None  # the sequential decision of a claim on the trained policies
    cells: tuple = ()  # ((table role, swept values), ...): the cells it compares, where more seeds would go
    paper_diff: float | None = None  # the paper's own difference a - b (accuracy / 100), where it has one
    group: str = "paper"  # "paper": the paper's claims; "corrections": each rollout correction against SMD and dense
    pair: tuple[str, str] = ("", "")  # (a, b) of a main-table comparison
    prompts: str = ""  # PER_SEED: about the task's prompts; FIXED: about the fixed held-out prompts its runs shared; "": no runs

    @property
    def pending(self) -> bool:
        return self.decision is not None and self.decision.pending


@lru_cache(maxsize=None)
def _config(run_dir: str) -> dict:
    """A run's resolved config (its config.json), {} when it cannot be read."""
    try:
        return records.read_object(Path(run_dir) / "config.json")
    except (OSError, records.Damaged):
        return {}


def _prompts(run_dir: str) -> int | None:
    """The held-out prompts a run evaluated (`eval.num_prompts` of its config.json), None when it does not say."""
    held = _config(run_dir).get("eval")
    n = held.get("num_prompts") if isinstance(held, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def draw(run_dir) -> str:
    """The held-out draw a run's config.json records (`smd_cli.evaluation.heldout`: per_seed, or fixed for a run from before the key)."""
    return draw_of(_config(str(run_dir)))


def drawn(sweep: Sweep, seeds: list[str], *cells: dict) -> str:
    """PER_SEED when every run of these cells at these seeds evaluated its seed's own held-out prompts (its config.json's
    eval.prompts), FIXED when any evaluated the fixed ones (or does not say), "" without runs."""
    runs = [r for sel in cells for r in sweep.select(**sel) if r.attempted and r.values.get("seed", "") in seeds]
    if not runs:
        return ""
    return PER_SEED if all(draw(r.dir) == "per_seed" for r in runs) else FIXED


def about(prompts: str, m: Measure) -> str:
    """The words that say what a verdict is about, when it is not the task."""
    if prompts != FIXED:
        return ""
    n = f"{round(1 / m.resolution)} " if m.resolution else ""
    return f"about the {n}fixed held-out prompts that every seed evaluated, {NOT_THE_TASK}"


def failures(sweep: Sweep, seeds: list[str], cells: list[tuple[str, dict]]) -> str:
    """The failed runs of these cells at these seeds, named with how they ended (counted as the reward's worst)."""
    named = [f"{name} seed {r.values.get('seed', '?')} ({r.ended})" for name, sel in cells for r in sweep.failures(**sel)
             if r.values.get("seed", "") in seeds]
    return f"; failed runs, counted as 0 (the reward's worst): {'; '.join(named)}" if named else ""


def measure(sweep: Sweep, *cells: dict) -> Measure:
    """The held-out reward of these cells as a verdict must know it: in [0, 1], averaged over the fewest held-out
    prompts any of their runs evaluated (the coarsest resolution); no resolution when a run's config does not say."""
    counts = [_prompts(str(r.dir)) for sel in cells for r in sweep.select(**sel) if r.ok]
    return Measure.rewards(None if not counts or None in counts else min(counts))


def _difference(dec: Decision, margin: float | None, m: Measure) -> str:
    d = dec.d
    if d.mean is None:
        return "no paired seeds"
    text = f"paired difference {plus_minus(d.mean, d.se, signed=True)} over {d.n} seeds"
    if dec.se is not None and dec.se > 1e-9 and dec.verdict not in UNINFORMATIVE:
        if dec.floored:
            text += (f", se floored at {number(dec.se)} (the reward's resolution: one of {round(1 / m.resolution)} held-out prompts"
                     + (f", sqrt({margin} / N) within the margin" if margin and margin > m.resolution else "") + ")")
        text += f", t = {(d.mean + (margin or 0.0)) / dec.se:.3g}"
    elif d.se is not None and d.se <= 1e-9 and dec.verdict not in UNINFORMATIVE:
        text += ", se 0 and the number of held-out prompts unknown: nothing measured"
    return text


def outcome(dec: Decision, rule: Sequential, margin: float | None = None, paper_diff: float | None = None) -> str:
    """The decision's look, critical value and, undecided, what it would take."""
    if dec.verdict in UNINFORMATIVE:
        where = "ceiling (1)" if dec.verdict == CEILING else "floor (0)"
        return (f"; every run of both cells at the reward's {where} over {dec.seeds} seeds: the metric cannot tell them apart "
                "here (uninformative, not a verdict; no seed count decides it)")
    if dec.critical is None:
        return "; fewer than 2 paired seeds" + (f", next look at {rule.next_look(dec.seeds) or rule.looks[0]} seeds" if dec.pending else "")
    look = f"look {rule.looks.index(dec.seeds) + 1} of {len(rule.looks)}" if dec.seeds in rule.looks else f"{dec.seeds} seeds"
    text = f" against c = {dec.critical:.2f} ({look})"
    if dec.pending:
        text += f"; next look at {rule.next_look(dec.seeds)} seeds"
    elif dec.verdict == INCONCLUSIVE:
        what = "difference" if margin is None else f"distance from -{margin}"
        text += f"; smallest {what} detectable at the cap ({rule.power:.0%} power): {number(dec.detectable)}" if dec.detectable else ""
        if paper_diff is not None:
            text += f" (the paper's difference: {paper_diff:+.3f})"
        text += f"; a decision needs about {dec.seeds_needed} seeds" if dec.seeds_needed else "; no seed count decides a difference of 0"
    return text


def compare(claim, paper, sweep: Sweep, role: str, scope: str, a: dict, b: dict, names: tuple[str, str], rule: Sequential,
            margin: float | None = None, paper_diff: float | None = None, group: str = "paper", pair=("", "")) -> list[Finding]:
    """One finding per evaluation view: a vs b (swept values), `stats.sequential` on their per-seed differences
    (with `margin`: the parity test)."""
    out = []
    m = measure(sweep, a, b)
    worst = m.low  # a failed run counts as the reward's worst value
    for view, metric in VIEWS.items():
        seeds, diffs = sweep.paired(metric, a, b, worst)
        va, vb = sweep.by_seed(metric, worst, **a), sweep.by_seed(metric, worst, **b)
        dec = sequential(diffs, rule, margin, m, ([va.get(s) for s in seeds], [vb.get(s) for s in seeds]))
        used = seeds[: dec.seeds]
        prompts = drawn(sweep, used, a, b)
        evidence = (about(prompts, m) + f"{names[0]} {sweep.cell(metric, used, worst, **a)} vs {names[1]} "
                    f"{sweep.cell(metric, used, worst, **b)}; " + _difference(dec, margin, m) + outcome(dec, rule, margin, paper_diff)
                    + failures(sweep, used, [(names[0], a), (names[1], b)]))
        out.append(Finding(claim, paper, GREATER if margin is None else NOT_WORSE, scope, evidence, dec.verdict, view, dec,
                           ((role, a), (role, b)), paper_diff, group, pair, prompts))
    return out


def _paper_diff(a: str, b: str) -> float | None:
    return (PAPER_GSM8K[a] - PAPER_GSM8K[b]) / 100 if a in PAPER_GSM8K and b in PAPER_GSM8K else None


def main_table(sweep: Sweep, rule: Sequential, role: str = "main") -> list[Finding]:
    """The paper's claims on the algorithms at 50 % compression, per task, and every other correction present judged
    the same way against SMD and against dense."""
    out = []
    algos = sweep.values("algo")
    tasks = sweep.values("task") if "task" in sweep.keys else [""]
    for task in tasks:
        t = {"task": task} if task else {}
        scope = f"task {task}" if task else "main table"

        def judge(claim, paper, a, b, margin=None, group="paper", gsm8k=True):
            return compare(claim, paper, sweep, role, scope, {**t, "algo": a}, {**t, "algo": b}, (a, b), rule, margin,
                           _paper_diff(a, b) if gsm8k else None, group, (a, b))

        if {"smd", "dense"} <= set(algos):
            out += judge("SMD is near-lossless against dense at 50 % compression", "GSM8K 73.6 vs 74.5", "smd", "dense", MARGIN)
        if "smd" in algos:
            for x in (x for x in algos if x not in ("smd", "dense")):
                paper = f"GSM8K 73.6 vs {PAPER_GSM8K[x]}" if x in PAPER_GSM8K else "-"
                out += judge(f"SMD beats {NAMES.get(x, x)}", paper, "smd", x, group="paper" if x in PAPER_GSM8K else "corrections")
        if {"dense", "naive_sparse"} <= set(algos):
            out += judge("Naive compression falls behind dense", "GSM8K 64.3 vs 74.5", "dense", "naive_sparse")
        if "dense" in algos:
            for x in (x for x in algos if x not in ("smd", "dense")):
                out += judge(f"{NAMES.get(x, x)} recovers the dense learner's result", "-", x, "dense", MARGIN, "corrections")
        if task == "tldr" and {"smd", "dense"} <= set(algos):  # its reward is ROUGE-L
            out += judge("SMD beats dense in ROUGE-L on TL;DR", "SMD above dense", "smd", "dense", gsm8k=False)
    return out


def composite(parts: dict[str, list[Finding]], claim: str, paper: str, scope: str, rule_text: str, view: str) -> Finding:
    """A claim made of several comparisons (each judged at alpha / their number, `Sequential.split`): holds if every
    part holds, does not hold if any part does not, uninformative (ceiling) if every part is, pending while a part is
    pending, else inconclusive."""
    found = {name: next(f for f in fs if f.view == view) for name, fs in parts.items()}
    verdicts = {f.verdict for f in found.values()}
    pending = [f for f in found.values() if f.pending]
    verdict = (FAILS if FAILS in verdicts else HOLDS if verdicts == {HOLDS} else verdicts.pop()
               if len(verdicts) == 1 and verdicts <= set(UNINFORMATIVE) else INCONCLUSIVE)
    decisions = [f.decision for f in found.values()]
    decision = Decision(verdict, min(d.seeds for d in decisions), Cell(None, None, 0), None,
                        pending=verdict == INCONCLUSIVE and bool(pending),
                        detectable=max((d.detectable for d in decisions if d.detectable is not None), default=None))
    prompts = FIXED if any(f.prompts == FIXED for f in found.values()) else PER_SEED if found else ""
    lead = next((f.evidence.split(NOT_THE_TASK)[0] + NOT_THE_TASK for f in found.values() if f.prompts == FIXED), "")
    evidence = lead + "; ".join(f"{name}: {f.evidence.split(NOT_THE_TASK)[-1].split('; ', 1)[1]} ({f.verdict})" for name, f in found.items())
    cells = tuple(dict.fromkeys((role, tuple(sel.items())) for f in (pending or found.values()) for role, sel in f.cells))
    return Finding(claim, paper, rule_text, scope, evidence, verdict, view, decision, tuple((r, dict(s)) for r, s in cells),
                   prompts=prompts)


def compression(sweep: Sweep, rule: Sequential, role: str = "compression") -> list[Finding]:
    if not {"0.5", "0.7"} <= set(sweep.values("compression")):
        return []
    out = []
    if "smd" in sweep.values("algo"):
        out += compare("SMD stays robust at 70 % compression", "robust at 70 %", sweep, role, "70 % vs 50 %",
                       {"algo": "smd", "compression": "0.7"}, {"algo": "smd", "compression": "0.5"}, ("smd@0.7", "smd@0.5"), rule, MARGIN)
    if "sparse_rl" in sweep.values("algo"):
        out += compare("Sparse-RL degrades at 70 % compression", "collapses (variance explosion)", sweep, role, "50 % vs 70 %",
                       {"algo": "sparse_rl", "compression": "0.5"}, {"algo": "sparse_rl", "compression": "0.7"},
                       ("sparse_rl@0.5", "sparse_rl@0.7"), rule)
        if "smd" in sweep.values("algo"):
            out += compare("SMD beats Sparse-RL at 70 % compression", "SMD robust, Sparse-RL collapses", sweep, role, "70 %",
                           {"algo": "smd", "compression": "0.7"}, {"algo": "sparse_rl", "compression": "0.7"},
                           ("smd@0.7", "sparse_rl@0.7"), rule)
    return out


def lambda_best(sweep: Sweep, rule: Sequential, role: str = "lambda") -> list[Finding]:
    """lambda = 0.1 is the best: significantly above every other value tried (each at alpha / their number); it does
    not hold if another value is significantly above it."""
    values = sweep.values("lambda")
    if "0.1" not in values:
        return []
    others = [v for v in values if v != "0.1"]
    split = rule.split(len(others))
    parts = {f"0.1 vs {v}": compare("", "", sweep, role, "", {"lambda": "0.1"}, {"lambda": v}, ("0.1", v), split) for v in others}
    text = (f"holds if 0.1 is above every other value (the rule of a > b for each, at alpha / {len(others)}), does not hold if "
            "another value is above it")
    out = [composite(parts, "lambda = 0.1 is the best distillation weight", "0.1 best of the values tried",
                     "lambda " + ", ".join(values), text, view) for view in VIEWS]
    if "0.8" in values:
        out += compare("lambda = 0.8 degrades against 0.1", "excessive distillation degrades", sweep, role, "0.1 vs 0.8",
                       {"lambda": "0.1"}, {"lambda": "0.8"}, ("lambda=0.1", "lambda=0.8"), rule)
    return out


def selection(sweep: Sweep, rule: Sequential, role: str = "selection") -> list[Finding]:
    policies = sweep.values("eviction")
    if not {"snapkv", "random"} <= set(policies):
        return []
    others = [p for p in ("recent", "random") if p in policies]
    split = rule.split(len(others))
    parts = {f"smd@{p}": compare("", "", sweep, role, "", {"eviction": p, "algo": "smd"}, {"eviction": "snapkv", "algo": "smd"},
                                 (f"smd@{p}", "smd@snapkv"), split, MARGIN) for p in others}
    text = f"every one matches smd@snapkv (the rule of 'a matches b', margin {MARGIN}, each at alpha / {len(others)})"
    out = [composite(parts, "SMD is robust across token selection (SnapKV, Recent, Random)", "robust across the three",
                     ", ".join(others) + " vs snapkv", text, view) for view in VIEWS]
    out += compare("With Random selection SMD holds up where naive compression fails", "naive fails with Random", sweep, role,
                   "random", {"eviction": "random", "algo": "smd"}, {"eviction": "random", "algo": "naive_sparse"},
                   ("smd@random", "naive@random"), rule)
    out += compare("Naive compression fails with Random selection", "naive fails with Random", sweep, role, "snapkv vs random",
                   {"eviction": "snapkv", "algo": "naive_sparse"}, {"eviction": "random", "algo": "naive_sparse"},
                   ("naive@snapkv", "naive@random"), rule)
    return out


def policies(sweeps: dict[str, Sweep], rule: Sequential) -> list[Finding]:
    """Every claim on the trained policies, from the tables present (roles main, compression, lambda, selection)."""
    judges = {"main": main_table, "compression": compression, "lambda": lambda_best, "selection": selection}
    return [f for role, judge in judges.items() if role in sweeps for f in judge(sweeps[role], rule, role)]


def wanted(findings: list[Finding], rule: Sequential) -> dict[tuple[str, tuple], int]:
    """Where more seeds go: (table role, swept values as a tuple of pairs) -> the seed count of the next look, for
    every cell of every pending finding (the highest count when several want the same cell)."""
    out: dict[tuple[str, tuple], int] = {}
    for f in findings:
        if not f.pending:
            continue
        target = rule.next_look(f.decision.seeds) if f.decision.seeds >= rule.looks[0] else rule.looks[0]
        for role, selector in f.cells:
            key = (role, tuple(sorted(selector.items())))
            out[key] = max(out.get(key, 0), target)
    return out
