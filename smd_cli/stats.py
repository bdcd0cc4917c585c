"""Statistics over seeds: means with standard errors, and the verdict rules of the reproduction's claims.

A cell of a table is the mean over the seeds (runs) that finished, with its standard error
`s / sqrt(n)` (s the sample standard deviation, n - 1 in the denominator; none below two runs). Two cells
are compared through their difference `d = a - b` and `se(d) = sqrt(se_a^2 + se_b^2)` (independent seeds),
and a claim's verdict follows from where the interval `d +- Z se(d)` lies (Z = 2, about 95 %):

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


@dataclass(frozen=True)
class Verdict:
    verdict: str
    difference: float | None
    se: float | None


def _difference(a: Cell, b: Cell) -> tuple[float | None, float | None]:
    if a.mean is None or b.mean is None:
        return None, None
    se = math.sqrt(a.se**2 + b.se**2) if a.se is not None and b.se is not None else None
    return a.mean - b.mean, se


def greater(a: Cell, b: Cell) -> Verdict:
    """Is a > b?"""
    d, se = _difference(a, b)
    if d is None or se is None:
        return Verdict(INCONCLUSIVE, d, se)
    return Verdict(HOLDS if d - Z * se > 0 else FAILS if d + Z * se < 0 else INCONCLUSIVE, d, se)


def not_worse(a: Cell, b: Cell, margin: float) -> Verdict:
    """Does a match b within `margin` (a not worse than b by more than the margin)?"""
    d, se = _difference(a, b)
    if d is None or se is None:
        return Verdict(INCONCLUSIVE, d, se)
    return Verdict(HOLDS if d - Z * se >= -margin else FAILS if d + Z * se < -margin else INCONCLUSIVE, d, se)


def at_most(x: Cell, bound: float) -> Verdict:
    """Is x <= bound? (A number without a standard error, e.g. a deterministic memory ratio, is taken as exact.)"""
    if x.mean is None:
        return Verdict(INCONCLUSIVE, None, None)
    se = x.se or 0.0
    return Verdict(HOLDS if x.mean + Z * se <= bound else FAILS if x.mean - Z * se > bound else INCONCLUSIVE, x.mean - bound, x.se)


def at_least(x: Cell, bound: float) -> Verdict:
    """Is x >= bound? (As `at_most`, mirrored.)"""
    v = at_most(Cell(None if x.mean is None else -x.mean, x.se, x.n), -bound)
    return Verdict(v.verdict, None if v.difference is None else -v.difference, v.se)
