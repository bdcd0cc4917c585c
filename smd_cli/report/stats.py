"""Statistics over seeds: means with standard errors, and the verdict rules of the reproduction's claims.

A cell of a table is the mean over the seeds (runs) that have results, with its standard error `s / sqrt(n)`
(s the sample standard deviation, n - 1 in the denominator; none below two runs). Two cells are compared
through their paired difference (`difference`): d, the mean over the seeds both have of the per-seed
differences `a_s - b_s`, and se(d) its standard error (a seed's runs share their warm start, prompts and
sampling, so the spread between warm starts cancels out). A claim's verdict follows from the t statistic
T = d / se(d) (for parity within a margin m, T = (d + m) / se(d)) against a critical value c, the Student t
quantile with n - 1 degrees of freedom at one-sided level alpha (with 3 seeds, 2 degrees of freedom, c is 4.30
at alpha = 0.025, not the normal's 1.96: a rule of "2 standard errors" says "holds" for 9 % of true nulls):

- ordering ("a > b"): holds if `T > c`, does not hold if `T < -c`, else inconclusive;
- parity within a margin m ("a matches b"): holds if `(d + m) / se >= c` (a is not worse than b by m),
  does not hold if `(d + m) / se < -c` (a is worse by more than m), else inconclusive;
- a bound ("x <= t"): holds if `x + c se <= t`, does not hold if `x - c se > t`, else inconclusive.
With a single seed (no standard error) every comparison of two cells is inconclusive: one run proves nothing.
A bound on a number measured once without noise (a memory ratio) compares the number itself.

Seeds until decided (`Sequential`): a comparison is looked at when n_1, n_2, ..., n_K seeds are in (the last,
the cap), and stops at the first look whose T crosses that look's critical value. The one-sided error alpha is
split over the looks in advance in proportion to the seeds each look adds, alpha_k = alpha (n_k - n_{k-1}) / n_K
(n_0 = 0: every seed carries an equal share; the power family alpha tau^rho of Kim and DeMets with rho = 1), and
look k uses the t quantile at 1 - alpha_k. By the union bound (Bonferroni over the looks) the chance that any look
says "holds" when the true difference is 0 is at most sum(alpha_k) = alpha, whatever the dependence between looks and
whenever the comparison stops: the rule stays valid under optional stopping. Why this split: with looks at 3, 5
and 8 seeds, the first look has 2 degrees of freedom, where the t quantile grows fast as alpha_k shrinks. The
O'Brien-Fleming-type spending used before (`obrien_fleming`) gave it alpha_1 = 0.00025, c = 44.5: with the floor of
one prompt in 32 below, no mean difference under 0.80 could cross it, so the first look could only ever say
"ceiling" or "pending". The equal share gives it 3/8 of alpha, c = 7.20: a true difference of 4.8 per-seed
standard deviations is decided at 3 seeds with 80 % probability (it needed 26 before). The price is paid at the
cap: c = 3.04 at 8 seeds instead of 2.50, so the smallest difference the cap detects with 80 % probability is
1.39 per-seed standard deviations instead of 1.20. (Pocock-type spending, alpha ln(1 + (e - 1) tau), would give
c = 6.22 first and 3.28 at the cap: little more early for more lost at the cap.)
A comparison still inconclusive at the cap reports the smallest true difference its last look would have
detected with probability `power` (`Decision.detectable`), and the seeds a fixed-sample test at the last look's
own alpha_K would need (`Decision.seeds_needed`): the alpha a look at the cap actually spends, not the total.

Held-out prompts, the second random factor. A seed's paired difference d_s is a mean over the N held-out prompts its
runs evaluated. Two arms equal over the task still differ prompt by prompt (an arm x prompt interaction: training
makes one policy better on some keys or depths, the other on others), so d_s = delta + (the mean interaction of its
N prompts) + the seed's own noise. Where every seed evaluates the same N prompts (`eval.prompts=fixed`, what every
run did before that key), the interaction term is the same in every d_s: no number of seeds averages it out and the
seeds' spread does not show it, so the test is about those N prompts and says "holds" about the task too often.
Simulated (`tests/test_stats.py`'s `interaction`, 10,000 trials: per-prompt logits with an arm x prompt spread of
0.5 / 1 / 2, N = 32, looks at 3 / 5 / 8 seeds, true difference 0 over the task): the old rule (fixed prompts,
O'Brien-Fleming spending) said "holds" for 3.4 % / 5.9 % / 13.6 % of such comparisons, against the 2.5 % promised
(12.5 % near the ceiling, 21.8 % with digit credit, 10.4 % with heavy-tailed interactions, at spread 2). Where each seed draws its own
prompts (`eval.prompts=per_seed`, the default, `smd_cli.evaluation.heldout`), the interaction enters each d_s as independent
noise of variance sigma^2 / N, which the seeds' spread includes: each seed is an independent draw of (warm start,
sampling, prompts), the test above is unchanged, and its error rate holds over the task's prompt population (1.7 %,
1.8 %, 1.7 % with this rule; 1.1 %, 1.5 %, 1.8 % near the ceiling, with digit credit, with heavy tails). This
design is also the more precise one: the interaction is averaged over n N prompts, not N. The alternative, prompts
as a crossed random factor (every run's per-prompt scores kept, a two-way decomposition of the variance with
Satterthwaite degrees of freedom), keeps the interaction's sigma^2 / N in the standard error at any seed count and
has an uncertain, small number of degrees of freedom at 3 seeds; it would be needed only to judge runs that
evaluated fixed prompts, whose per-prompt scores were not kept. A verdict over runs with fixed prompts is therefore
reported as about those prompts (`smd_cli.report.claims`), never about the task.

Bounded, discrete metrics (`Measure`). This project's held-out metrics are rewards in [0, 1] averaged over N
prompts: binary (1/N steps), digit credit (passkey: 1/(5N) steps), near or at their ceiling. The t test assumes
the seeds' spread is estimated well, and on such data it is not: with 3 to 8 seeds a difference that moves by one
prompt's worth (+-1/16 over 16 prompts) is all +1/16 on 3 seeds one time in 8, its sample standard deviation is
0, and a rule that let se = 0 decide by the sign of d said "a > b holds" for 13.8 % of true nulls (looks at 3, 5
and 8 seeds; promised: 2.5 %); an arm near its bound is skewed (a run of seeds without a miss has a high mean and a
small spread together), so "a matches b" at the margin's edge with b at the ceiling said "holds" for 10.8 % of nulls
at 16 prompts and 6.2 % at 64 (4.0 % with se = 0 already set aside: the skew alone). Three rules keep the promised
alpha on exactly such data (simulated in `tests/test_stats.py`: normal and heavy-tailed noise, binary rewards
over 16 and 64 prompts with p near and at 1, digit credit, an arm at the bound; every rate at or below alpha):

- A cell at the bound says so. Where every run of both cells sits at the metric's upper (lower) bound, nothing
  was measured: the verdict is "uninformative (ceiling)" ("... (floor)"), final (more seeds of a metric stuck at
  its bound cannot decide; stopping for futility never raises the error of a "holds"), never "holds".
- The standard deviation of the per-seed differences has a floor, from the metric's resolution r (one prompt's
  worth, (high - low) / N; `Measure.rewards(N)`): sd_floor = sqrt(r * max(r, |null|)), null the difference at
  the hypothesis' edge (0 for "a > b", -margin for "a matches b"). Why: the per-seed difference of two means over
  N prompts is (prompts where a gains - prompts where b gains) / N. Seeds can differ by one prompt at the least,
  so no spread below one prompt's worth is evidence of anything (sd >= r); and two arms whose means differ by
  |null| = k / N disagree on at least k prompts a seed on average, a count whose chance spread is at least its square root
  (Poisson; McNemar's test of paired binary outcomes takes exactly the number of discordant pairs as the
  variance), sd >= sqrt(k) / N = sqrt(r |null|). A floor is a lower bound on what the test assumes, never a
  replacement for the data: where the seeds spread more, their own sd is used. Where it binds it costs power
  (and on digit credit, whose steps are a fifth of a prompt, it is conservative by design); it only shrinks |T|,
  so no look becomes likelier to say "holds" (the union bound over the looks holds term by term).
  The floor of the whole prompt rather than the digit is what keeps digit credit valid when a prompt's digits
  fail together (an all-or-nothing passkey). A continuous metric (ROUGE) gets the floor of one prompt too: it
  binds only when seeds agree within one prompt's worth, and at the paper's 512 prompts it is 0.002.
- se = 0 never decides. Without a known resolution (`Measure()`: a measurement, not a mean over prompts) a
  standard error of 0 gives "inconclusive": a number that does not vary over 3 seeds is not a measurement of
  its own noise.

The rules use the same t quantiles and spending as above; only the standard error they divide by is bounded
below (`Measure.se`), and `detectable` and `seeds_needed` are computed with that same bounded standard error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

Z = 2.0  # the old rule's multiplier, kept only to show (tests) why it was replaced
ALPHA = 0.025  # one-sided error of each verdict, each direction (a two-sided 95 % interval)
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
CEILING, FLOOR = "uninformative (ceiling)", "uninformative (floor)"  # every run of both cells at the metric's bound
USABLE = ("ok", "collapsed")  # run statuses with held-out results: a collapsed policy is an outcome, not a failure


@dataclass(frozen=True)
class Cell:
    """A mean over n runs and its standard error (None below two runs); mean None when no run reports it."""

    mean: float | None
    se: float | None
    n: int

    def __str__(self) -> str:
        return plus_minus(self.mean, self.se)


def plus_minus(mean: float | None, se: float | None = None, signed: bool = False) -> str:
    """The one way a mean and its standard error are written: `0.720 ± 0.012` (`number`'s digits; no se: the mean
    alone; no mean: `-`); `signed`: a difference of rewards, `+0.300 ± 0.012`, three decimals (the rewards' own
    resolution: a difference's se of 2e-17 is 0.000)."""
    if mean is None:
        return "-"
    if signed:
        return f"{mean:+.3f}" + ("" if se is None else f" ± {se:.3f}")
    return number(mean) + ("" if se is None else f" ± {number(se)}")


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
    """Rows grouped by the values of `keys` (in first-seen order): per metric the mean over the group's runs with
    results (status "ok" or "collapsed") that report it and its standard error (`"{metric} se"`), with `runs` (in the
    group), `n` (with results) and `collapsed` (how many of those collapsed)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for values, members in groups.items():
        done = [r for r in members if r["status"] in USABLE]
        group = {**dict(zip(keys, values)), "runs": len(members), "n": len(done),
                 "collapsed": sum(r["status"] == "collapsed" for r in done)}
        for m in metrics:
            c = cell(r.get(m) for r in done)
            group[m], group[f"{m} se"] = c.mean, c.se
        out.append(group)
    return out


@dataclass(frozen=True)
class Measure:
    """What a verdict must know of the metric it compares: its bounds (`low`, `high`; None: unbounded) and its
    resolution (the step one held-out prompt makes in a per-seed mean, (high - low) / N over N prompts; None:
    unknown, no floor). Module docstring: why the standard error has a floor, and why a cell at a bound says so."""

    low: float | None = None
    high: float | None = None
    resolution: float | None = None

    @classmethod
    def rewards(cls, prompts: int | None) -> "Measure":
        """A reward in [0, 1] averaged over `prompts` held-out prompts (None: their number is unknown)."""
        return cls(0.0, 1.0, 1.0 / prompts if prompts else None)

    def sd_floor(self, null: float = 0.0) -> float:
        """The least standard deviation of a per-seed difference the test assumes: sqrt(r * max(r, |null|)), null
        the difference at the hypothesis' edge (0 for a > b, -margin for parity); 0 without a resolution."""
        r = self.resolution
        return 0.0 if not r else math.sqrt(r * max(r, abs(null)))

    def se(self, d: Cell, null: float = 0.0) -> float | None:
        """The standard error a verdict divides by: d's own, bounded below by `sd_floor(null) / sqrt(n)`."""
        if d.se is None:
            return None
        return max(d.se, self.sd_floor(null) / math.sqrt(d.n))

    def bound(self, values) -> str | None:
        """CEILING (FLOOR) when every value is at the upper (lower) bound, else None (also for no values)."""
        xs = [v for v in values if v is not None]
        if not xs:
            return None
        if self.high is not None and all(x >= self.high for x in xs):
            return CEILING
        if self.low is not None and all(x <= self.low for x in xs):
            return FLOOR
        return None


EXACT = Measure()  # a measured number: no bounds, no resolution (se = 0 stays inconclusive)


def difference(a: dict, b: dict) -> Cell:
    """The paired difference a - b: mean and standard error of the per-seed differences `a[s] - b[s]` over the
    seeds both report (the runs of one seed share their warm start, prompts and sampling seed, so a seed's
    runs differ only by what is compared; the spread between warm starts cancels out)."""
    return cell(a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None)


# --- the Student t and normal distributions (no scipy: exact finite sums for integer degrees of freedom) ---

def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with an integer `df` >= 1 (Abramowitz & Stegun 26.7.3-4, exact finite sums)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ... up to c^(df-2))
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    else:  # 2/pi (theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ... up to c^(df-3)))
        total = 0.0
        if df > 1:
            term, total = 1.0, 1.0
            for k in range(1, (df - 1) // 2):
                term *= c2 * (2 * k) / (2 * k + 1)
                total += term
        inside = 2 / math.pi * (theta + s * math.cos(theta) * total)
    return 0.5 + math.copysign(inside / 2, t)


def normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _invert(cdf, p: float) -> float:
    """x with cdf(x) = p, by bisection (cdf increasing, symmetric about 0)."""
    if not 0 < p < 1:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -_invert(cdf, 1 - p)
    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


@lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    return _invert(lambda x: t_cdf(x, df), p)


@lru_cache(maxsize=256)
def normal_quantile(p: float) -> float:
    return _invert(normal_cdf, p)


# --- the verdict rules ---

def critical(n: int, alpha: float = ALPHA) -> float | None:
    """The critical value of a one-sided test at level `alpha` with n seeds (None below 2: no standard error)."""
    return t_quantile(1 - alpha, n - 1) if n >= 2 else None


def _t_verdict(distance: float, se: float, c: float, strict: bool = True) -> str:
    """holds if distance / se crosses +c, does not hold if it crosses -c; se 0 (up to float rounding: 0.72 - 0.42 and
    0.74 - 0.44 differ in the 17th digit) is inconclusive: nothing measured."""
    if se <= 1e-12 * max(1.0, abs(distance)):
        return INCONCLUSIVE
    t = distance / se
    return HOLDS if (t > c if strict else t >= c) else FAILS if t < -c else INCONCLUSIVE


def greater(d: Cell, alpha: float = ALPHA, measure: Measure = EXACT) -> str:
    """Is a > b, given their difference d = a - b (one look, t critical value at `alpha`, se bounded by `measure`)?"""
    if d.mean is None or d.se is None:
        return INCONCLUSIVE
    return _t_verdict(d.mean, measure.se(d), critical(d.n, alpha))


def not_worse(d: Cell, margin: float, alpha: float = ALPHA, measure: Measure = EXACT) -> str:
    """Does a match b within `margin` (a not worse by more than the margin), given d = a - b?"""
    if d.mean is None or d.se is None:
        return INCONCLUSIVE
    return _t_verdict(d.mean + margin, measure.se(d, -margin), critical(d.n, alpha), strict=False)


def at_most(x: Cell, bound: float, alpha: float = ALPHA) -> str:
    """Is x <= bound? (A number without a standard error, e.g. a deterministic memory ratio, is taken as exact.)"""
    if x.mean is None:
        return INCONCLUSIVE
    if x.se is None:
        return HOLDS if x.mean <= bound else FAILS
    return _t_verdict(bound - x.mean, x.se, critical(x.n, alpha), strict=False)


def at_least(x: Cell, bound: float, alpha: float = ALPHA) -> str:
    """Is x >= bound? (As `at_most`, mirrored.)"""
    return at_most(Cell(None if x.mean is None else -x.mean, x.se, x.n), -bound, alpha)


@dataclass(frozen=True)
class Sequential:
    """Seeds until decided: looks at `looks` seeds (increasing; the last is the cap), one-sided error `alpha` per
    direction over all looks, split in proportion to the seeds each look adds (module docstring). `power`: for the
    detectable difference of a comparison that reaches the cap undecided."""

    looks: tuple[int, ...] = (3,)
    alpha: float = ALPHA
    power: float = 0.8

    def __post_init__(self):
        looks = tuple(int(n) for n in self.looks)
        if not looks or looks[0] < 1 or any(b <= a for a, b in zip(looks, looks[1:])):
            raise ValueError(f"looks must be increasing seed counts >= 1, got {list(self.looks)}")
        if not 0 < self.alpha < 0.5 or not 0 < self.power < 1:
            raise ValueError(f"need 0 < alpha < 0.5 and 0 < power < 1, got alpha={self.alpha}, power={self.power}")
        object.__setattr__(self, "looks", looks)

    @property
    def cap(self) -> int:
        return self.looks[-1]

    def spend(self) -> list[float]:
        """alpha_k of each look: alpha (n_k - n_{k-1}) / n_K (n_0 = 0), an equal share per seed, summing to alpha."""
        return list(_spend(self.looks, self.alpha))

    def split(self, parts: int) -> "Sequential":
        """The same looks at alpha / parts (Bonferroni over a claim made of `parts` comparisons)."""
        return replace(self, alpha=self.alpha / parts)

    def next_look(self, n: int) -> int | None:
        """The seed count of the first look after n seeds, None at or past the cap."""
        return next((m for m in self.looks if m > n), None)


@lru_cache(maxsize=64)
def _spend(looks: tuple[int, ...], alpha: float) -> tuple[float, ...]:
    return tuple(alpha * (n - before) / looks[-1] for before, n in zip((0, *looks), looks))


def obrien_fleming(looks: tuple[int, ...], alpha: float = ALPHA) -> tuple[float, ...]:
    """The spending this module used before (module docstring): increments of 2 - 2 Phi(z_{1-alpha/2} / sqrt(tau)),
    tau = n_k / n_K; kept only to show (tests, the report's rule) why it was replaced."""
    z = normal_quantile(1 - alpha / 2)
    spent = [2 - 2 * normal_cdf(z / math.sqrt(n / looks[-1])) for n in looks]
    return tuple(b - a for a, b in zip([0.0, *spent], spent))


@dataclass(frozen=True)
class Decision:
    """A comparison judged by `Sequential`: its verdict, the look that gave it (its seed count), the paired
    difference there, that look's critical value, whether a later look can still decide (`pending`), and for a
    comparison inconclusive at the cap the smallest detectable difference and the seeds a decision would need.
    `se`: the standard error the test divided by (d's own, or the metric's floor where that is larger)."""

    verdict: str
    seeds: int  # seeds the deciding (or last) look used
    d: Cell  # the paired difference at that look
    critical: float | None
    pending: bool = False
    detectable: float | None = None
    seeds_needed: int | None = None
    se: float | None = None

    @property
    def floored(self) -> bool:
        """The metric's floor, not the seeds' spread, set the standard error."""
        return self.se is not None and self.d.se is not None and self.se > self.d.se


def sequential(diffs: list[float | None], rule: Sequential, margin: float | None = None, measure: Measure = EXACT,
               arms: tuple[list, list] | None = None) -> Decision:
    """Judge the per-seed differences a_s - b_s, in seed order (None where a seed has no pair), look by look.

    Look k uses the first `rule.looks[k]` seeds and is judged once that many seeds were run (`len(diffs)`); the first
    look that crosses its critical value decides (`greater`'s test, or with `margin` `not_worse`'s, the standard
    error bounded below by `measure`). `arms`: the two cells' per-seed values a_s and b_s (aligned with `diffs`);
    where every one of a look's paired values sits at the metric's bound the verdict is CEILING (FLOOR), final.
    Undecided, the decision is pending while a look remains, else inconclusive at the cap with `detectable` (the
    smallest true difference, or distance from -margin, that the last look detects with probability `rule.power`)
    and `seeds_needed` (fixed-sample t test at the last look's alpha_K and `rule.power` for the observed difference)."""
    spend = rule.spend()
    shift = margin or 0.0
    last = None
    for k, n in enumerate(rule.looks):
        if len(diffs) < n:
            break
        d = cell(diffs[:n])
        c = critical(d.n, spend[k])
        se = measure.se(d, -shift)
        last = (n, d, c, se)
        if arms is not None:
            paired = [i for i in range(n) if diffs[i] is not None]
            at_bound = measure.bound([arm[i] for arm in arms for i in paired])
            if at_bound:
                return Decision(at_bound, n, d, c, se=se)
        if se is not None:
            verdict = _t_verdict(d.mean + shift, se, c, strict=margin is None)
            if verdict != INCONCLUSIVE:
                return Decision(verdict, n, d, c, se=se)
    if last is None:  # not even the first look's seeds
        return Decision(INCONCLUSIVE, len(diffs), cell(diffs), None, pending=True)
    n, d, c, se = last
    if n < rule.cap:
        return Decision(INCONCLUSIVE, n, d, c, pending=True, se=se)
    detectable = None if not se else (c + t_quantile(rule.power, d.n - 1)) * se
    return Decision(INCONCLUSIVE, n, d, c, detectable=detectable, seeds_needed=seeds_needed(d, shift, rule, measure), se=se)


def seeds_needed(d: Cell, shift: float, rule: Sequential, measure: Measure = EXACT, most: int = 10_000) -> int | None:
    """Seeds for a fixed-sample one-sided t test at the last look's alpha_K (the alpha the cap actually spends) to
    decide a true difference of d's size (its mean + shift, its standard deviation s, bounded below by the metric's
    floor) with probability `rule.power`: the least n with (t_{1-alpha_K, n-1} + t_{power, n-1}) s / sqrt(n) <=
    |mean + shift|; None when that is 0 (or s is) or past `most`."""
    if d.mean is None or d.se is None:
        return None
    alpha = rule.spend()[-1]
    effect, sd = abs(d.mean + shift), measure.se(d, -shift) * math.sqrt(d.n)
    if effect == 0 or sd == 0:  # undecided with no spread: a difference of exactly 0, which no seed count decides
        return None
    n = 2
    while n <= most:
        if (t_quantile(1 - alpha, n - 1) + t_quantile(rule.power, n - 1)) * sd / math.sqrt(n) <= effect:
            return n
        n = n + 1 if n < 64 else int(n * 1.1)
    return None
