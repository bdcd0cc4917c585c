"""The paper's claims on the machinery (what the learner computes, its memory and its time), and the ones this scale
cannot test, each with its rule: bounds on benchmark ratios and on per-step fractions (`smd_cli.report.stats`, one look,
the t critical value), the shadow replay's parity against the sampler read from the training runs (float32) and
from `smd check-parity`'s parity.json (every eviction policy, float32 and float64: rounding told from a mask error).
"""

from __future__ import annotations

from smd_cli.checks.contracts import LEARNER_MEMORY_RATIO, PARITY_BOUNDS
from smd_cli.report.claims import NOT_MEASURED, Finding
from smd_cli.report.data import Sweep
from smd_cli.report.stats import FAILS, HOLDS, INCONCLUSIVE, Cell, at_least, at_most, cell

PARITY_BOUND = PARITY_BOUNDS["float32"]  # the training runs' parity is read in float32


def rejection(sweep: Sweep) -> list[Finding]:
    """Sparse-RL's rejections per task (the paper: often more than 20 % of the trajectories)."""
    out = []
    if "sparse_rl" not in sweep.values("algo"):
        return out
    for task in sweep.values("task") if "task" in sweep.keys else [""]:
        t = {"task": task} if task else {}
        rejected = sweep.cell("steps:is/rejected_seq_frac:mean", **t, algo="sparse_rl")
        out.append(Finding("Sparse-RL's rejection discards many rollouts", "often > 20 % of trajectories",
                           "fraction >= 0.2: holds if (mean - 0.2) / se >= c, does not hold if < -c (c: t critical value, n - 1 df)",
                           f"task {task}, training" if task else "training",
                           f"sequences vetoed per step {rejected}, tokens masked "
                           f"{sweep.cell('steps:is/rejected_token_frac:mean', **t, algo='sparse_rl')}",
                           NOT_MEASURED if not rejected.n else at_least(rejected, 0.2) if rejected.se is not None else INCONCLUSIVE))
    return out


def tldr(tasks: list[str]) -> list[Finding]:
    if "tldr" in tasks:
        return []
    return [Finding("SMD beats dense in ROUGE-L on TL;DR", "SMD above dense", "-", "-", "no TL;DR at this scale", NOT_MEASURED)]


def parity(sweeps: list[Sweep], check: dict | None) -> list[Finding]:
    """The shadow replay's learner log-probs equal the sampler's, over every SMD run of the sweeps (a run that several
    tables share counts once). A run that ended `parity_broken` (its guard found a learner that is not its sampler)
    makes the claim fail, named; an SMD run that failed otherwise (diverged, stopped by an error) had its parity never
    judged to the end, so the claim cannot hold over every run (inconclusive, named). With `check` (`smd check-parity`'s
    parity.json): judged by its float64 replay, where rounding cannot hide a mask error (a miss beyond the bound and
    beyond 10 x the float32 rounding), every eviction policy; the float32 numbers of every completed SMD training run and
    of the check are the rounding beside it. Without it: the training runs' float32 maximum against the float32 bound."""
    key = "train/mismatch/max_abs_diff_max"
    every = list({r.dir: r for s in sweeps for r in s.runs if r.attempted}.values())
    everyone = [r for r in every if r.values.get("algo", "smd") == "smd"]
    broken = [r for r in everyone if r.summary.get("status") == "parity_broken"]
    unjudged = [r for r in everyone if r.failed and r not in broken]
    runs = [r for r in every if r.ok and isinstance(r.summary.get(key), (int, float))]
    smd = [r for r in runs if r.values.get("algo", "smd") == "smd"]
    naive = [r for r in runs if r.values.get("algo") == "naive_sparse"]
    evidence = []
    if broken:
        evidence.append(f"parity broken in {len(broken)} of {len(everyone)} SMD runs: "
                        + "; ".join(f"{r.dir.name} ({r.ended})" for r in broken))
    if unjudged:
        evidence.append(f"{len(unjudged)} SMD runs failed before their parity was judged to the end: "
                        + "; ".join(f"{r.dir.name} ({r.ended})" for r in unjudged))
    if smd:
        worst = max(r.summary[key] for r in smd)
        typical = cell(r.metric("steps:mismatch/mean_abs_diff:mean") for r in smd)
        evidence.append(f"training, float32: max |log p_learner - log p_sampler| over every token of every step of {len(smd)} SMD "
                        f"runs {worst:.2g}" + ("" if typical.mean is None else f", its mean per token {typical.mean:.2g}"))
        contrast = max((r.summary[key] for r in naive), default=None)
        if contrast is not None:
            evidence[-1] += f" (naive_sparse's dense learner: up to {contrast:.3g})"
    policies = {p: r for p, r in ((check or {}).get("policies") or {}).items() if "shadow_float64" in r.get("views", {})}
    every_run = ("; over every SMD run of the sweeps: one that ended parity_broken makes it not hold, one that failed before "
                 "its parity was judged to the end leaves it inconclusive")
    if policies:
        views = {p: r["views"] for p, r in policies.items()}
        wrong = [p for p, r in policies.items() if "shadow_float64" in r.get("failed", [])]
        evidence.append(f"smd check-parity, {', '.join(policies)}: shadow replay in float32 up to "
                        f"{max(v['shadow']['max_abs_diff'] for v in views.values()):.2g}, in float64 up to "
                        f"{max(v['shadow_float64']['max_abs_diff'] for v in views.values()):.2g} (float32 rounding up to "
                        f"{max(v['shadow_float64']['rounding'] for v in views.values()):.2g})"
                        + (f"; a mask error under {', '.join(wrong)}" if wrong else ""))
        verdict = FAILS if wrong or broken else INCONCLUSIVE if unjudged else HOLDS
        rule = (f"holds if no eviction policy's float64 replay misses the sampler beyond {check.get('bound', PARITY_BOUND):g} and "
                "beyond 10 x the float32 rounding (smd check-parity: what float64 leaves is a mask error); the float32 numbers "
                "are the rounding" + every_run)
    elif smd or broken or unjudged:
        verdict = (FAILS if broken or (smd and worst > PARITY_BOUND) else INCONCLUSIVE if unjudged or not smd else HOLDS)
        rule = f"holds if the largest difference <= {PARITY_BOUND:g} (float32; no float64 replay measured)" + every_run
    else:
        return []
    return [Finding("The shadow mask makes the learner's policy the sampler's", "pi_sparse = pi_shadow, exactly", rule,
                    f"all {len(everyone)} SMD runs" + (", every eviction policy" if policies else ""), "; ".join(evidence), verdict)]


def memory(bench: dict | None) -> list[Finding]:
    if not bench:
        return []
    algos, views = bench["algorithms"], bench["views"]
    size = bench["size"]
    scope = f"{size['layers']} layers x {size['hidden']}, vocab {size['vocab']}, {bench['device']}"
    if size.get("model"):  # a real model's weights (bench/learner_memory.py --model), not random widths
        scope = f"{size['model']}: {scope}"
    smd = algos["smd"]["dynamic_over_naive_sparse"]
    sparse_rl = algos["sparse_rl"]["total_over_naive_sparse"]
    physical, shadow = views["snapkv"]["physical"]["over_dense"], views["snapkv"]["shadow"]["over_dense"]
    return [
        Finding("SMD's learner stays at the baseline's memory", "SMD 100 % of baseline VRAM",
                f"holds if SMD / naive_sparse dynamic learner memory <= {LEARNER_MEMORY_RATIO} (DESIGN.md contract 3)", scope,
                f"SMD / naive_sparse {smd:.3f}", at_most(Cell(smd, None, 1), LEARNER_MEMORY_RATIO)),
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
        out.append(Finding("SMD's training step costs under 10 % more than naive sparse's", "< 10 % of training time",
                           "holds if (1.10 - mean) / se >= c over the rounds' ratios, does not hold if < -c (c: t critical value)",
                           overhead_size(bench),
                           f"smd / naive_sparse step {c} over {c.n} rounds (median {bench['over_naive_sparse']['smd']:.3f})",
                           at_most(c, 1.10) if c.se is not None else INCONCLUSIVE))
    return out


def overhead_size(bench: dict) -> str:
    """What a `bench/step_overhead.py` result ran: the model (a named one, `--model`, or random widths) and the batch."""
    a = bench["args"]
    model = a['model'] if a.get('model') else f"{a['layers']} layers x {a['hidden']}"
    group = a.get("group", 1)
    return (f"{model}, {a['rows']} x (P {a['prompt']} + R {a['response']}), "
            + (f"{group} rows per prompt" if group > 1 else "distinct prompts"))
