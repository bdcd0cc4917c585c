"""What `smd reproduce` runs next and what it costs: the seeds its undecided claims want, grouped into `smd ablate`
invocations, and the cost model that predicts its duration.

The cost model (CPU seconds on this project's 2-core machine, one thread per run, measured with short timed runs:
README, "Reproducing the paper"): a run costs `run_s` (start, imports, the model from the warm-start cache) +
`step_s` per GRPO step + `eval_prompt_s` per held-out prompt and evaluation (after training, 2 x 2 evaluations:
dense cache and under eviction, sampled and greedy; the same again before training, but once for all the runs that
evaluate the same starting point the same way, `Planned.before`, since `eval.reuse_before` reads the others from
`smd_cli.evaluation.cache`); each (task, seed) warm start costs `warm_step_s` per supervised step, once; the benchmarks `benchmarks_s`, one after another, and `overhead_s` the rest
(each `smd ablate`'s start and its last run alone on a core, the report). With `jobs` runs at once the runs' total
divides by `jobs`. Library code: no Hydra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from smd_cli.report.data import Sweep


@dataclass(frozen=True)
class Cost:
    run_s: float
    step_s: float
    eval_prompt_s: float
    warm_step_s: float
    benchmarks_s: float = 0.0
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Planned:
    """One training run as the cost model sees it."""

    task: str
    seed: str
    steps: int
    eval_prompts: int
    evaluations: int  # held-out evaluations of `eval_prompts` each after training (as many before)
    warm_steps: int
    before: tuple = ()  # what the evaluations before training depend on besides the code: runs with the same share them


def run_seconds(p: Planned, cost: Cost) -> float:
    return cost.run_s + p.steps * cost.step_s + p.evaluations * p.eval_prompts * cost.eval_prompt_s


def predict(runs: list[Planned], cost: Cost, jobs: int, done_warm: set = frozenset()) -> float:
    """Wall seconds to run `runs` (`jobs` at once), their evaluations before training (once per `before`) and their
    warm starts not in `done_warm` ((task, seed) pairs), benchmarks excluded."""
    warm = {(p.task, p.seed): p.warm_steps for p in runs if (p.task, p.seed) not in done_warm}
    before = {(p.before, p.eval_prompts): p.evaluations * p.eval_prompts * cost.eval_prompt_s for p in runs}
    return (sum(run_seconds(p, cost) for p in runs) + sum(before.values()) + sum(warm.values()) * cost.warm_step_s) / jobs


@dataclass(frozen=True)
class Prediction:
    """The cost model's minutes: the runs to run now, the seeds every claim would add if none were decided before the cap
    (the worst case), the benchmarks and the rest."""

    runs_now: int
    now_s: float
    runs_more: int
    worst_s: float
    rest_s: float
    cap: int
    jobs: int

    @property
    def most_s(self) -> float:
        return self.now_s + self.worst_s + self.rest_s

    def __str__(self) -> str:
        return (f"{self.runs_now} runs now, {self.now_s / 60:.0f} min; if every claim stayed undecided to the cap of {self.cap} "
                f"seeds, {self.runs_more} runs more, {self.worst_s / 60:.0f} min; benchmarks and the rest {self.rest_s / 60:.0f} "
                f"min: at most {self.most_s / 60:.0f} min with {self.jobs} runs at once")


def prediction(planned: dict, cells: set, todo: set[str], cap: int, cost: Cost, jobs: int) -> Prediction:
    """The minutes of the runs to run now (`planned`: (role, cell, seed) -> (identity, Planned); those in `todo`), and of
    the seeds every claim would add if none were decided before `cap` (the claims' `cells`, a run shared by tables
    counted once: the worst case), with the benchmarks and the rest."""
    base = {ident: p for ident, p in planned.values() if ident in todo}
    firsts = [(ident, p) for (role, cell, seed), (ident, p) in planned.items() if (role, cell) in cells]
    seeds = sorted({p.seed for _, p in firsts}, key=int)
    extra = {ident: p for ident, p in firsts if p.seed == seeds[0]} if seeds else {}
    more = [Planned(p.task, str(s), p.steps, p.eval_prompts, p.evaluations, p.warm_steps, renamed(p.before, p.seed, str(s)))
            for p in extra.values() for s in range(len(seeds), cap)]
    return Prediction(len(base), predict(list(base.values()), cost, jobs), len(more), predict(more, cost, jobs),
                      cost.benchmarks_s + cost.overhead_s, cap, jobs)


def renamed(before: tuple, seed: str, new: str) -> tuple:
    """The `Planned.before` of the same run at seed `new` (the seed is part of it when the evaluation depends on it)."""
    return tuple(f"seed={new}" if part == f"seed={seed}" else part for part in before)


@dataclass(frozen=True)
class Extension:
    """One `smd ablate` invocation adding seeds: a table's role, its swept values fixed or swept (key -> values, in the
    sweep's order), and the seeds."""

    role: str
    values: tuple[tuple[str, tuple[str, ...]], ...]
    seeds: tuple[str, ...]

    def overrides(self) -> list[str]:
        return [*(f"{k}={','.join(v)}" for k, v in self.values), f"seed={','.join(self.seeds)}"]

    @property
    def runs(self) -> int:
        count = len(self.seeds)
        for _, v in self.values:
            count *= len(v)
        return count

    @property
    def label(self) -> str:
        text = "seeds" + "-".join(self.seeds) + "".join(f"_{'-'.join(v)}" for _, v in self.values[:-1])
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)


def extensions(wanted: dict[tuple[str, tuple], int], sweeps: dict[str, Sweep]) -> list[Extension]:
    """The invocations that bring every wanted cell ((role, swept values) -> seed count) to its count: the seeds
    0 .. count - 1 it has no results for. Cells of a table wanting the same seeds are grouped by the values of their
    swept keys but the last (whose values are swept); groups with the same last values and one other key are merged
    (`task=needle,vote algo=smd,tis`), so that an invocation is a product of values with no run asked in vain.
    Ordered by table, then as the cells came."""
    groups: dict[tuple, list[str]] = {}
    for (role, selector), count in wanted.items():
        sweep, chosen = sweeps[role], dict(selector)
        have = {r.values.get("seed") for r in sweep.select(**chosen) if r.ok}
        seeds = tuple(str(s) for s in range(count) if str(s) not in have)
        swept = [k for k in sweep.keys if k != "seed" and k in chosen]
        if not seeds or not swept:
            continue
        values = groups.setdefault((role, tuple((k, chosen[k]) for k in swept[:-1]), swept[-1], seeds), [])
        if chosen[swept[-1]] not in values:
            values.append(chosen[swept[-1]])
    merged: dict[tuple, list[str]] = {}
    for (role, fixed, key, seeds), values in groups.items():
        if len(fixed) == 1:  # one other key: merge the groups that sweep the same last values
            outer = merged.setdefault((role, fixed[0][0], key, tuple(values), seeds), [])
            outer.append(fixed[0][1])
        else:
            merged[(role, fixed, key, tuple(values), seeds)] = None
    order = list(sweeps)
    found = []
    for (role, fixed, key, values, seeds), outer in merged.items():
        ordered = sweeps[role].values  # every key's values in the sweep's order
        swept = ((fixed, tuple(v for v in ordered(fixed) if v in outer)),) if outer is not None else tuple((k, (v,)) for k, v in fixed)
        found.append(Extension(role, (*swept, (key, tuple(v for v in ordered(key) if v in values))), seeds))
    return sorted(found, key=lambda e: order.index(e.role))
