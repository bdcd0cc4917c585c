"""The paper's claims, each with the rule that turns the measured data into a verdict.

Every verdict is computed here from the sweeps and the benchmarks, never typed: comparisons of held-out
metrics use `smd_cli.stats` (the paired difference over seeds and its standard error; `holds` / `does not
hold` / `inconclusive`), bounds on benchmark ratios compare the measured number with the bound. A claim about the
trained policies is judged twice, once per way of evaluating them on the held-out split: with a dense KV
cache, and under the run's eviction (a dense-trained policy under SnapKV at the same compression), since
the paper's tables do not say which one they use and SMD optimises the second.

The paper's numbers are from `../shared/REFERENCES.md` section 1 (the paper's body is not public).
"""

from __future__ import annotations

from dataclasses import dataclass

from smd_cli.report.data import Sweep
from smd_cli.stats import FAILS, HOLDS, INCONCLUSIVE, Cell, at_least, at_most, cell, difference, greater, not_worse

MARGIN = 0.05  # "matches" / "robust": not worse by more than 0.05 of the metric (fixed before any run)
VIEWS = {"dense cache": "eval/reward_after", "under eviction": "eval/evict/reward_after"}
PARITY_BOUND = 1e-5  # DESIGN.md contract 1, float32
NOT_MEASURED = "not measured"


@dataclass
class Finding:
    claim: str  # the paper's claim
    paper: str  # what the paper reports
    rule: str  # how the verdict follows from the data
    scope: str  # where it was tested (task, size, values compared)
    evidence: str  # the numbers it rests on
    verdict: str
    view: str | None = None  # the held-out evaluation (a key of VIEWS) for claims on the trained policies


def _pair(name_a: str, a: Cell, name_b: str, b: Cell, d: Cell) -> str:
    return f"{name_a} {a} vs {name_b} {b}; paired difference {'-' if d.mean is None else f'{d.mean:+.3f}'}" + \
        ("" if d.se is None else f" ± {d.se:.3f}") + f" over {d.n} seeds"


GREATER = "a > b: holds if d - 2 se > 0, does not hold if d + 2 se < 0 (d: mean of the per-seed differences a - b)"
NOT_WORSE = f"a matches b: holds if d - 2 se >= -{MARGIN}, does not hold if d + 2 se < -{MARGIN} (d: mean of the per-seed a - b)"


def _compare(claim, paper, sweep: Sweep, scope: str, a: dict, b: dict, names: tuple[str, str], margin: float | None = None):
    """One finding per evaluation view: a vs b (swept values) by their paired difference, with `greater` or, with
    a margin, `not_worse`."""
    out = []
    for view, metric in VIEWS.items():
        d = difference(sweep.by_seed(metric, **a), sweep.by_seed(metric, **b))
        verdict = greater(d) if margin is None else not_worse(d, margin)
        out.append(Finding(claim, paper, GREATER if margin is None else NOT_WORSE, scope,
                           _pair(names[0], sweep.cell(metric, **a), names[1], sweep.cell(metric, **b), d), verdict, view))
    return out


def main_table(sweep: Sweep) -> list[Finding]:
    """Claims on the five algorithms at 50 % compression, per task of the main table."""
    out = []
    tasks = sweep.values("task") if "task" in sweep.keys else [""]
    for task in tasks:
        t = {"task": task} if task else {}
        scope = f"task {task}" if task else "main table"
        out += _compare("SMD is near-lossless against dense at 50 % compression", "GSM8K 73.6 vs 74.5", sweep, scope,
                        {**t, "algo": "smd"}, {**t, "algo": "dense"}, ("smd", "dense"), MARGIN)
        out += _compare("SMD beats Sparse-RL", "GSM8K 73.6 vs 71.2", sweep, scope, {**t, "algo": "smd"}, {**t, "algo": "sparse_rl"},
                        ("smd", "sparse_rl"))
        out += _compare("SMD beats naive compression", "GSM8K 73.6 vs 64.3", sweep, scope, {**t, "algo": "smd"},
                        {**t, "algo": "naive_sparse"}, ("smd", "naive_sparse"))
        out += _compare("Naive compression falls behind dense", "GSM8K 64.3 vs 74.5", sweep, scope, {**t, "algo": "dense"},
                        {**t, "algo": "naive_sparse"}, ("dense", "naive_sparse"))
        rejected = sweep.cell("steps:is/rejected_seq_frac:mean", **t, algo="sparse_rl")
        out.append(Finding("Sparse-RL's rejection discards many rollouts", "often > 20 % of trajectories",
                           "fraction >= 0.2: holds if mean - 2 se >= 0.2, does not hold if mean + 2 se < 0.2", f"{scope}, training",
                           f"sequences vetoed per step {rejected}, tokens masked "
                           f"{sweep.cell('steps:is/rejected_token_frac:mean', **t, algo='sparse_rl')}",
                           at_least(rejected, 0.2) if rejected.n else NOT_MEASURED))
        if task == "tldr":
            out += _compare("SMD beats dense in ROUGE-L on TL;DR", "SMD above dense", sweep, scope, {**t, "algo": "smd"},
                            {**t, "algo": "dense"}, ("smd", "dense"))
    if "tldr" not in tasks:
        out.append(Finding("SMD beats dense in ROUGE-L on TL;DR", "SMD above dense", "-", "-", "no TL;DR at this scale",
                           NOT_MEASURED))
    return out


def parity(sweeps: list[Sweep]) -> list[Finding]:
    """The shadow replay's learner log-probs equal the sampler's, in every SMD run of every sweep."""
    smd = [r for s in sweeps for r in s.runs if r.ok and r.values.get("algo", "smd") == "smd" and "train/mismatch/max_abs_diff_max" in r.summary]
    naive = [r for s in sweeps for r in s.runs if r.ok and r.values.get("algo") == "naive_sparse" and "train/mismatch/max_abs_diff_max" in r.summary]
    if not smd:
        return []
    worst = max(r.summary["train/mismatch/max_abs_diff_max"] for r in smd)
    contrast = max((r.summary["train/mismatch/max_abs_diff_max"] for r in naive), default=None)
    typical = cell(r.metric("steps:mismatch/mean_abs_diff:mean") for r in smd)
    evidence = (f"max |log p_learner - log p_sampler| over every token of every step of {len(smd)} SMD runs: {worst:.2g}; "
                f"its mean per token {typical.mean:.2g}")
    if contrast is not None:
        evidence += f" (naive_sparse's dense learner: up to {contrast:.3g})"
    return [Finding("The shadow mask makes the learner's policy the sampler's", "pi_sparse = pi_shadow, exactly",
                    f"holds if the largest difference <= {PARITY_BOUND:g} (float32)", "all SMD runs", evidence,
                    HOLDS if worst <= PARITY_BOUND else FAILS)]


def compression(sweep: Sweep) -> list[Finding]:
    if "0.7" not in sweep.values("compression"):
        return []
    c = {"algo": "smd"}
    out = _compare("SMD stays robust at 70 % compression", "robust at 70 %", sweep, "70 % vs 50 %", {**c, "compression": "0.7"},
                   {**c, "compression": "0.5"}, ("smd@0.7", "smd@0.5"), MARGIN)
    out += _compare("Sparse-RL degrades at 70 % compression", "collapses (variance explosion)", sweep, "50 % vs 70 %",
                    {"algo": "sparse_rl", "compression": "0.5"}, {"algo": "sparse_rl", "compression": "0.7"},
                    ("sparse_rl@0.5", "sparse_rl@0.7"))
    out += _compare("SMD beats Sparse-RL at 70 % compression", "SMD robust, Sparse-RL collapses", sweep, "70 %",
                    {"algo": "smd", "compression": "0.7"}, {"algo": "sparse_rl", "compression": "0.7"}, ("smd@0.7", "sparse_rl@0.7"))
    return out


def lambda_best(sweep: Sweep) -> list[Finding]:
    """lambda = 0.1 best: no other value significantly above it, and it significantly above at least one."""
    values = sweep.values("lambda")
    if "0.1" not in values:
        return []
    out = []
    for view, metric in VIEWS.items():
        best = sweep.by_seed(metric, **{"lambda": "0.1"})
        gaps = {v: difference(sweep.by_seed(metric, **{"lambda": v}), best) for v in values if v != "0.1"}  # other - 0.1
        above = [v for v, d in gaps.items() if greater(d) == HOLDS]
        below = [v for v, d in gaps.items() if greater(Cell(None if d.mean is None else -d.mean, d.se, d.n)) == HOLDS]
        highest = all(d.mean is None or d.mean <= 0 for d in gaps.values())
        verdict = FAILS if above else HOLDS if below and highest else INCONCLUSIVE
        evidence = "; ".join(f"lambda={v}: {sweep.cell(metric, **{'lambda': v})}" for v in values)
        evidence += f". Significantly below 0.1 (paired): {', '.join(below) or 'none'}; above: {', '.join(above) or 'none'}"
        out.append(Finding("lambda = 0.1 is the best distillation weight", "0.1 best of the values tried",
                           "holds if 0.1 has the highest mean and is significantly above at least one value (paired d - 2 se > 0), "
                           "does not hold if another value is significantly above it", "lambda values", evidence, verdict, view))
    if "0.8" in values:
        out += _compare("lambda = 0.8 degrades against 0.1", "excessive distillation degrades", sweep, "0.1 vs 0.8",
                        {"lambda": "0.1"}, {"lambda": "0.8"}, ("lambda=0.1", "lambda=0.8"))
    return out


def selection(sweep: Sweep) -> list[Finding]:
    policies = sweep.values("eviction")
    if not {"snapkv", "random"} <= set(policies):
        return []
    out = []
    for view, metric in VIEWS.items():
        base = sweep.by_seed(metric, eviction="snapkv", algo="smd")
        checks = {p: not_worse(difference(sweep.by_seed(metric, eviction=p, algo="smd"), base), MARGIN)
                  for p in ("recent", "random") if p in policies}
        verdicts = set(checks.values())
        verdict = FAILS if FAILS in verdicts else HOLDS if verdicts == {HOLDS} else INCONCLUSIVE
        evidence = f"smd@snapkv {sweep.cell(metric, eviction='snapkv', algo='smd')}; " + "; ".join(
            f"smd@{p} {sweep.cell(metric, eviction=p, algo='smd')} ({v})" for p, v in checks.items())
        out.append(Finding("SMD is robust across token selection (SnapKV, Recent, Random)", "robust across the three",
                           f"every one matches smd@snapkv (the rule of 'a matches b', paired, margin {MARGIN})", "recent, random vs snapkv",
                           evidence, verdict, view))
    out += _compare("With Random selection SMD holds up where naive compression fails", "naive fails with Random", sweep,
                    "random", {"eviction": "random", "algo": "smd"}, {"eviction": "random", "algo": "naive_sparse"},
                    ("smd@random", "naive@random"))
    out += _compare("Naive compression fails with Random selection", "naive fails with Random", sweep, "snapkv vs random",
                    {"eviction": "snapkv", "algo": "naive_sparse"}, {"eviction": "random", "algo": "naive_sparse"},
                    ("naive@snapkv", "naive@random"))
    return out


def memory(bench: dict | None) -> list[Finding]:
    if not bench:
        return []
    algos, views = bench["algorithms"], bench["views"]
    size = bench["size"]
    scope = f"{size['layers']} layers x {size['hidden']}, vocab {size['vocab']}, {bench['device']}"
    smd = algos["smd"]["dynamic_over_naive_sparse"]
    sparse_rl = algos["sparse_rl"]["total_over_naive_sparse"]
    physical, shadow = views["snapkv"]["physical"]["over_dense"], views["snapkv"]["shadow"]["over_dense"]
    return [
        Finding("SMD's learner stays at the baseline's memory", "SMD 100 % of baseline VRAM",
                "holds if SMD / naive_sparse dynamic learner memory <= 1.05 (DESIGN.md contract 3)", scope,
                f"SMD / naive_sparse {smd:.3f}", at_most(Cell(smd, None, 1), 1.05)),
        Finding("Sparse-RL's learner needs 150 % of the baseline's memory", "+1.24 GB, 150 % of baseline",
                "holds if Sparse-RL / naive_sparse learner memory (dynamic + static) >= 1.35 (within 10 % of 1.5)", scope,
                f"Sparse-RL / naive_sparse {sparse_rl:.3f} (its frozen reference model included)", at_least(Cell(sparse_rl, None, 1), 1.35)),
        Finding("Physical eviction spikes the learner's memory, the mask does not", "not-in-place allocation spikes",
                "holds if physical / dense forward+backward >= 1.10 and shadow / dense <= 1.05 (SnapKV rollout)", scope,
                f"physical / dense {physical:.3f}, shadow / dense {shadow:.3f}" + "".join(
                    f"; {p}: physical {v['physical']['over_dense']:.3f}, shadow {v['shadow']['over_dense']:.3f}"
                    for p, v in views.items() if p != "snapkv"),
                HOLDS if physical >= 1.10 and shadow <= 1.05 else FAILS),
    ]


def overhead(benches: list[dict]) -> list[Finding]:
    out = []
    for bench in benches:
        rounds = bench["rounds_over_naive_sparse"].get("smd")
        if not rounds:
            continue
        c = cell(rounds)
        a = bench["args"]
        group = a.get("group", 1)
        out.append(Finding("SMD's training step costs under 10 % more than naive sparse's", "< 10 % of training time",
                           "holds if mean + 2 se <= 1.10 over the rounds' ratios, does not hold if mean - 2 se > 1.10",
                           f"{a['layers']} layers x {a['hidden']}, {a['rows']} x (P {a['prompt']} + R {a['response']})"
                           + (f", {group} rows per prompt" if group > 1 else ", distinct prompts"),
                           f"smd / naive_sparse step {c} over {c.n} rounds (median {bench['over_naive_sparse']['smd']:.3f})", at_most(c, 1.10)))
    return out


def separation(sweep: Sweep) -> list[str]:
    """Plain sentences: for each task and view, which algorithm pairs the data separates (a > b holds)."""
    lines = []
    algos = sweep.values("algo")
    for task in sweep.values("task") if "task" in sweep.keys else [None]:
        t = {"task": task} if task else {}
        for view, metric in VIEWS.items():
            pairs = [f"{a} > {b}" for a in algos for b in algos if a != b
                     and greater(difference(sweep.by_seed(metric, **t, algo=a), sweep.by_seed(metric, **t, algo=b))) == HOLDS]
            where = f"task {task}, {view}" if task else view
            lines.append(f"{where}: " + (", ".join(pairs) if pairs else "no pair of algorithms is separated (every paired "
                                                                       "difference within 2 se of 0)"))
    return lines
