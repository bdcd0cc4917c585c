"""Statistics over seeds: means with standard errors, and the verdict rules of the reproduction's claims.

A cell of a table is the mean over the seeds (runs) that finished, with its standard error
`s / sqrt(n)` (s the sample standard deviation, n - 1 in the denominator; none below two runs). Two cells
are compared through their paired difference (`difference`): d, the mean over the seeds both have of the
per-seed differences `a_s - b_s`, and se(d) its standard error (a seed's runs share their warm start, prompts
and sampling, so the spread between warm starts cancels out); a claim's verdict follows from where the
interval `d +- Z se(d)` lies (Z = 2, about 95 %):

- ordering ("a > b"): holds if `d - Z se > 0`, does not hold if `d + Z se < 0`, else inconclusive;
- parity within a margin m ("a matches b"): holds if `d - Z se >= -m` (a is not worse than b by m),
  does not hold if `d + Z se < -m` (a is worse by more than m), else inconclusive;
- a bound ("x <= t"): holds if `x + Z se <= t`, does not hold if `x - Z se > t`, else inconclusive.
With a single seed (no standard error) every comparison of two cells is inconclusive: one run proves
nothing. A bound on a number measured once without noise (a memory ratio) compares the number itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z = 2.0
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


@dataclass(frozen=True)
class Cell:
    """A mean over n runs and its standard error (None below two runs); mean None when no run reports it."""

    mean: float | None
    se: float | None
    n: int

    def __str__(self) -> str:
        if self.mean is None:
            return "-"
        return number(self.mean) + ("" if self.se is None else f" ± {number(self.se)}")


def number(x: float) -> str:
    """Three decimals in [0.01, 1000), else two significant digits (a 1e-6 mismatch is not 0.000)."""
    return f"{x:.3f}" if x == 0 or 0.01 <= abs(x) < 1000 else f"{x:.2g}"


def cell(values) -> Cell:
    """Mean and standard error of the finite numbers in `values` (None, NaN and non-numbers left out)."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not xs:
        return Cell(None, None, 0)
    mean = sum(xs) / len(xs)
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else None
    return Cell(mean, se, len(xs))


def aggregate(rows: list[dict], keys: list[str], metrics: list[str]) -> list[dict]:
    """Rows grouped by the values of `keys` (in first-seen order): per metric the mean over the group's finished
    runs (status "ok") that report it and its standard error (`"{metric} se"`), with `runs` (in the group) and
    `n` (finished)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for values, members in groups.items():
        done = [r for r in members if r["status"] == "ok"]
        group = {**dict(zip(keys, values)), "runs": len(members), "n": len(done)}
        for m in metrics:
            c = cell(r.get(m) for r in done)
            group[m], group[f"{m} se"] = c.mean, c.se
        out.append(group)
    return out


def difference(a: dict, b: dict) -> Cell:
    """The paired difference a - b: mean and standard error of the per-seed differences `a[s] - b[s]` over the
    seeds both report (the runs of one seed share their warm start, prompts and sampling seed, so a seed's
    runs differ only by what is compared; the spread between warm starts cancels out)."""
    return cell(a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None)


def greater(d: Cell) -> str:
    """Is a > b, given their difference d = a - b?"""
    if d.mean is None or d.se is None:
        return INCONCLUSIVE
    return HOLDS if d.mean - Z * d.se > 0 else FAILS if d.mean + Z * d.se < 0 else INCONCLUSIVE


def not_worse(d: Cell, margin: float) -> str:
    """Does a match b within `margin` (a not worse by more than the margin), given d = a - b?"""
    if d.mean is None or d.se is None:
        return INCONCLUSIVE
    return HOLDS if d.mean - Z * d.se >= -margin else FAILS if d.mean + Z * d.se < -margin else INCONCLUSIVE


def at_most(x: Cell, bound: float) -> str:
    """Is x <= bound? (A number without a standard error, e.g. a deterministic memory ratio, is taken as exact.)"""
    if x.mean is None:
        return INCONCLUSIVE
    se = x.se or 0.0
    return HOLDS if x.mean + Z * se <= bound else FAILS if x.mean - Z * se > bound else INCONCLUSIVE


def at_least(x: Cell, bound: float) -> str:
    """Is x >= bound? (As `at_most`, mirrored.)"""
    return at_most(Cell(None if x.mean is None else -x.mean, x.se, x.n), -bound)
