"""`REPORT.md` with its CSVs and PNGs, from the sweeps of a reproduction and its benchmarks.

Every number in the report is computed here from what the runs and benchmarks wrote; the only numbers typed
in are the paper's own (`claims.PAPER_GSM8K`, the claims' `paper` column), from `../shared/REFERENCES.md`.
"""

from __future__ import annotations

import csv
import time
from collections import Counter
from pathlib import Path

from smd_cli.report import claims, figures, machinery, tables
from smd_cli.report.data import Sweep, check_weights
from smd_cli.report.stats import FAILS, HOLDS, INCONCLUSIVE, Sequential, cell, critical
from smd_cli.report.tables import MAIN_COLUMNS, markdown
from smd_cli.runtime import records
from smd_cli.runtime.integrity import atomic_text, write_file

ABLATION_COLUMNS = [("held-out, under eviction", "eval/evict/reward_after"), ("held-out, dense cache", "eval/reward_after"),
                    ("greedy, under eviction", "eval/evict/greedy_reward_after"), ("training reward (last 10)", "steps:reward:last10"),
                    ("answer KV kept, held-out after", "eval/evict/kept_after")]
COLLAPSED = ("A run whose policy collapsed (status `collapsed`, `smd train`'s guard: its reward fell and stayed down) has its "
             "held-out numbers like any other and enters the means and the paired verdicts with them: the collapse is an outcome "
             "of the algorithm on that seed, and leaving it out would flatter the algorithm that collapses. It is counted in "
             "n and in 'collapsed', and marked † in the per-seed tables; `runs.csv` gives its reason. A run that failed (it "
             "diverged, its learner broke parity with its sampler, or an error stopped it) has no held-out numbers of its own: "
             "the tables count it in 'failed' and average the runs with results, and every paired verdict counts it as the "
             "reward's worst value, 0, naming it in its evidence, so that no comparison loses the seeds where an algorithm "
             "failed. (`make reproduce` runs a failed member again whenever it is run again, so a failure of the machine "
             "rather than of the algorithm goes away; what stays failed is what the algorithm does.)")


class Report:
    """Markdown sections and the CSVs beside them, written into `out`."""

    def __init__(self, out: Path):
        self.out = out
        self.lines: list[str] = []

    def text(self, *lines: str) -> None:
        self.lines += [*lines, ""]

    def table(self, name: str, header: list[str], rows: list[list]) -> None:
        """A markdown table here, and `name.csv` beside the report (the same cells)."""
        cells = [[_str(c) for c in r] for r in rows]
        self.lines += [markdown(header, cells)]
        with atomic_text(self.out / f"{name}.csv") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(cells)

    def figure(self, path: Path | None, caption: str) -> None:
        if path is not None:
            self.text(f"![{caption}]({path.name})")

    def save(self, name: str = "REPORT.md") -> Path:
        path = self.out / name
        write_file(path, "\n".join(self.lines).rstrip() + "\n")
        return path


def _str(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def write_report(out: Path, sweeps: dict[str, Sweep], bench: dict, header: dict, rule: Sequential | None = None) -> Path:
    """REPORT.md for the sweeps of roles `main`, `compression`, `lambda`, `selection` (any may be missing) and the
    benchmarks (`learner_memory`: one result, `step_overhead`: a list, `parity_check`: smd check-parity's parity.json), under `header`
    (scale, commit, versions, machine, wall seconds, commands, the cost model's prediction), the policy claims judged
    by `rule` (seeds until decided; default: one look at the seeds there are). Raises `data.WeightsDiffer`, writing
    nothing, when runs it would pool or pair ran different weights (`data.check_weights`)."""
    check_weights(sweeps)
    out.mkdir(parents=True, exist_ok=True)
    rule = rule or Sequential((max((len(s.seeds()) for s in sweeps.values()), default=1) or 1,))
    r = Report(out)
    main = sweeps.get("main")
    r.text(f"# Reproduction report: Shadow Mask Distillation (arXiv 2605.06850), {header['scale']} scale")
    if header.get("quick"):
        r.text("**Quick check** (`QUICK=1`): one seed, two values per ablation, a few steps per run. It shows that the "
               "pipeline works end to end; its numbers prove nothing.")
    r.text(*_header(header, sweeps, rule))
    r.text(*_setup(main or next(iter(sweeps.values()))))
    found = claims.policies(sweeps, rule)
    rest = _machinery(sweeps, bench)
    _claims_section(r, found, rest, rule)
    if main is not None:
        _main_section(r, main, found)
    for role, title, x_key, plot in (("compression", "Compression ablation", "compression", figures.ablation_lines),
                                     ("lambda", "Distillation weight (lambda) ablation", "lambda", figures.ablation_lines),
                                     ("selection", "Token-selection ablation", "eviction", figures.ablation_bars)):
        if role in sweeps:
            _ablation_section(r, sweeps[role], title, x_key, plot)
    _parity_section(r, bench.get("parity_check"))
    _memory_section(r, bench.get("learner_memory"))
    _overhead_section(r, bench.get("step_overhead") or [])
    _runs_csv(out, sweeps)
    r.text("## Files", "`claims.csv` (every verdict, with its look and detectable difference), one CSV per table above, "
           "`runs.csv` (every run of every sweep, per seed, with its status and directory), and the PNGs. The runs themselves "
           f"(checkpoints, `metrics.jsonl`, `summary.json`) stay in the runs directory: `{header.get('runs_dir', '-')}`.")
    return r.save()


def _header(header: dict, sweeps: dict[str, Sweep], rule: Sequential) -> list[str]:
    versions = header.get("versions", {})
    runs = {r.dir for s in sweeps.values() for r in s.runs if r.attempted}
    listed = sum(r.attempted for s in sweeps.values() for r in s.runs)
    seeds = sorted({v for s in sweeps.values() for v in s.seeds()}, key=lambda s: (len(s), s))
    wall = header.get("wall_seconds")
    commits = sorted({records.read_object(r.dir / "provenance.json", missing_ok=True).get("git_commit", "unknown") for s in sweeps.values() for r in s.runs if r.ok})
    ran = {r.dir: r.summary.get("model/compute_dtype", "float32 (not recorded)") for s in sweeps.values() for r in s.runs if r.ok}
    dtypes = Counter(ran.values())  # each run once, however many tables share it
    lines = [
        f"Generated by `{header.get('command', 'smd reproduce')}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"- commit `{header.get('commit', 'unknown')}` (report); the runs ran at {', '.join(f'`{c}`' for c in commits) or '-'} "
        "(each run's provenance.json)",
        f"- python {versions.get('python', '?')}, torch {versions.get('torch', '?')}, "
        f"transformers {versions.get('transformers', '?')}, hydra-core {versions.get('hydra-core', '?')}",
        f"- machine: {header.get('machine', '?')}; the runs' compute dtype (summary.json `model/compute_dtype`): "
        + (", ".join(f"{d} ({n} runs)" for d, n in sorted(dtypes.items())) or "-"),
        f"- seeds: {', '.join(seeds) or '-'} (each seed its own warm start and sampling); seeds until decided: looks at "
        f"{', '.join(map(str, rule.looks))} seeds (the cap {rule.cap}), each table's recipe giving the first",
        f"- {len(runs)} training runs for {listed} table entries (a run that several tables share ran once); "
        + (f"wall time of the invocation(s) that ran them, benchmarks included, {wall / 60:.1f} min" if isinstance(wall, (int, float))
           else "no invocation here ran a training run (every run's record was reused): their wall time is not recorded here"),
    ]
    if header.get("task"):
        lines.insert(2, f"- task: {header['task']} (every run of its tables, beside the scale's own settings)")
    if header.get("prediction"):
        lines.append(f"- cost model (`conf/reproduce.yaml` `cost`, README): {header['prediction']}")
    if header.get("rounds"):
        lines.append(f"- seeds added: {header['rounds']}")
    lines.append(f"- re-run: `{header.get('rerun', 'make reproduce')}`")
    return lines


def _setup(sweep: Sweep) -> list[str]:
    """What every run did, read from one finished run's resolved config."""
    run = next((r for r in sweep.runs if r.ok and (r.dir / "config.json").is_file()), None)
    if run is None:
        return ["No run finished: nothing to report."]
    cfg = records.read_object(run.dir / "config.json")
    g, m = cfg["grpo"], cfg["model"]
    arch = {**(m.get("architecture") or {}), **(m.get("config") or {})}  # a Hub model's published widths, or the built model's
    model = (f"{m['name']} ({arch.get('num_hidden_layers', '?')} layers, hidden {arch.get('hidden_size', '?')}, "
             f"{arch.get('num_attention_heads', '?')} heads / {arch.get('num_key_value_heads', '?')} KV heads)")
    warm = m.get("warmstart") or {}
    summary = records.read_summary(run.dir / "summary.json", missing_ok=True)
    if summary.get("model/weights"):  # which weights ran (a dequantised GGUF is not the original checkpoint)
        model += f", weights {summary['model/weights']}"
    return [
        "## Setup",
        f"Model {model}; {cfg['steps']} GRPO steps of {g['prompts_per_step']} prompts x {g['num_generations']} samples, "
        f"lr {cfg['optim']['lr']}, clip {g['epsilon']}, {g['loss_agg']}; SMD's lambda {cfg['lambda']} unless swept; "
        f"compression {cfg['compression']} unless swept. Task {_task(cfg['task'])}."
        + (f" The tiny model is first warm-started by {warm['steps']} supervised steps (label smoothing "
           f"{warm.get('label_smoothing', 0)}), one warm start per seed." if warm.get("steps") else ""),
        f"Held-out: {_held_out_prompts(sweep, cfg)}, sampled at temperature "
        f"{cfg['eval']['temperature']} (seeded) and greedy, each twice: with a dense KV cache, and under the run's eviction "
        f"policy and compression (a dense run under {cfg['eval']['dense_eviction']} at the same compression). The training reward "
        "is the sampler's own, under its eviction. 'answer KV kept' is the fraction of the answer-bearing prompt entries (the "
        "synthetic tasks' needle/marked values) that the eviction kept, over layers and KV heads.",
        COLLAPSED,
    ]


def _task(task: dict) -> str:
    """'ruler (family niah_multikey, haystack essay), prompt_tokens 1024, 16 new tokens' from a run's task config."""
    name = str(task.get("_target_", "?")).rsplit(".", 1)[-1].lower()
    kind = ", ".join(f"{k} {task[k]}" for k in ("family", "haystack") if task.get(k) is not None)
    return f"{name}{f' ({kind})' if kind else ''}, prompt_tokens {task.get('prompt_tokens', '-')}, {task.get('max_new_tokens', '-')} new tokens"


def _held_out_prompts(sweep: Sweep, cfg: dict) -> str:
    """How many held-out prompts each run evaluated, and whose: each seed its own, or the same for every run."""
    draws = {claims.draw(r.dir) for r in sweep.runs if r.attempted}
    n = cfg["eval"]["num_prompts"]
    if draws == {"per_seed"}:
        return f"{n} test prompts per seed, each seed its own (`eval.prompts=per_seed`; the runs of a seed share them)"
    return (f"{n} test prompts, the same for every run and seed (`eval.prompts=fixed`, or recorded before that key: the "
            "verdicts are about these prompts, not the task" + ("; some runs drew their own" if "per_seed" in draws else "") + ")")


def _machinery(sweeps: dict[str, Sweep], bench: dict) -> list[claims.Finding]:
    main = sweeps.get("main")
    found = machinery.rejection(main) if main is not None else []
    found += machinery.tldr(main.values("task") if main is not None and "task" in main.keys else [])
    found += machinery.parity(list(sweeps.values()), bench.get("parity_check"))
    found += machinery.memory(bench.get("learner_memory"))
    found += machinery.overhead(bench.get("step_overhead") or [])
    return found


def _claims_section(r: Report, found: list[claims.Finding], rest: list[claims.Finding], rule: Sequential) -> None:
    spend = rule.spend()
    r.text("## The paper's claims, judged from the data",
           "Each verdict is computed from the runs and benchmarks below by the rule beside it (`smd_cli/report/claims.py`, "
           "`smd_cli/report/stats.py`). Two cells are compared seed by seed: a seed's runs share their warm start, prompts and sampling "
           "seed, so d is the mean of the per-seed differences and se its standard error (the spread between warm starts cancels "
           f"out), t = d / se (for 'matches', within the margin {claims.MARGIN}: t = (d + {claims.MARGIN}) / se). The held-out "
           "reward is a mean over N prompts, so se is never taken below what its resolution allows (a per-seed spread of at least "
           f"one prompt's worth 1/N, and sqrt({claims.MARGIN} / N) for 'matches'), and a comparison whose runs all sit at the "
           "reward's bound says 'uninformative (ceiling)' (or floor): nothing was measured (`smd_cli/report/stats.py` says why, "
           "`tests/test_stats.py` simulates it). Every seed that ran is in the comparison: a failed run counts as the reward's "
           "worst, 0. A verdict is about the task's prompts when each seed evaluated its own held-out prompts; where the runs "
           "evaluated the same fixed prompts for every seed, an arm x prompt interaction is shared by all seeds and no seed "
           "count averages it out, so the verdict is about those prompts only, and its evidence says so. Seeds until "
           "decided: a comparison is looked at when the seeds below are in and stops at the first look where |t| passes that "
           "look's critical value c (Student t, n - 1 degrees of freedom, at the look's share alpha_k of the one-sided error "
           f"alpha = {rule.alpha}, in proportion to the seeds the look adds; Bonferroni over the looks, so the chance of a "
           f"wrong 'holds' stays at or below {rule.alpha} however the looks fall); `make reproduce` adds seeds to every comparison still "
           f"undecided, up to the cap. A comparison undecided at the cap gives the smallest difference its last look detects "
           f"with {rule.power:.0%} probability, beside the paper's own difference, and the seeds a decision would need. Each "
           f"verdict keeps its own error rate (alpha {rule.alpha} each way); over the table's many verdicts a few wrong ones "
           "are expected by chance. A claim on the trained policies is judged once per held-out evaluation: with a dense KV "
           "cache, and under the run's eviction.")
    r.table("looks", ["look", "seeds", "alpha_k", "c at that many seeds"],
            [[k + 1, n, f"{a:.2g}", f"{critical(n, a):.2f}" if n >= 2 else "-"] for k, (n, a) in enumerate(zip(rule.looks, spend))])
    views = list(claims.VIEWS)
    rows: dict[tuple, dict] = {}
    for f in found:
        if f.group == "paper":
            rows.setdefault((f.claim, f.paper, f.scope, f.rule), {})[f.view] = f
    r.table("claims_policies", ["claim", "paper", "scope", *(f"{v}: verdict (evidence)" for v in views), "rule"],
            [[claim, paper, scope, *(f"**{by[v].verdict}** ({by[v].evidence})" if v in by else "-" for v in views), rule]
             for (claim, paper, scope, rule), by in rows.items()])
    r.text(*_tally(found))
    if rest:
        r.table("claims_machinery", ["claim", "paper", "scope", "verdict", "evidence", "rule"],
                [[f.claim, f.paper, f.scope, f"**{f.verdict}**", f.evidence, f.rule] for f in rest])
    _claims_csv(r.out, found + rest)


def _tally(found: list[claims.Finding]) -> list[str]:
    """How many verdicts on the trained policies are decided, and which way."""
    paper = [f for f in found if f.group == "paper"]
    lines = []
    for name, group in (("the paper's claims", paper), ("the corrections' comparisons (main table)", [f for f in found if f.group != "paper"])):
        if not group:
            continue
        count = {v: sum(f.verdict == v for f in group) for v in (HOLDS, FAILS, INCONCLUSIVE)}
        bound = sum(f.verdict in claims.UNINFORMATIVE for f in group)
        pending = sum(f.pending for f in group)
        fixed = sum(f.prompts == claims.FIXED for f in group)
        lines.append(f"Of {len(group)} verdicts on {name}: {count[HOLDS]} hold, {count[FAILS]} do not hold, {count[INCONCLUSIVE]} "
                     "inconclusive" + (f" ({pending} of them pending: a later look would add seeds)" if pending else " at the cap")
                     + (f", {bound} uninformative (every run at the reward's bound)" if bound else "") + "."
                     + (f" {'All' if fixed == len(group) else fixed} of them rest on runs that evaluated the same fixed held-out "
                        "prompts for every seed: they are about those prompts, not the task." if fixed else ""))
    return lines


def _claims_csv(out: Path, found: list[claims.Finding]) -> None:
    with atomic_text(out / "claims.csv") as f:
        writer = csv.writer(f)
        writer.writerow(["claim", "paper", "scope", "view", "verdict", "prompts", "seeds", "d", "se", "critical", "pending", "detectable",
                         "paper_difference", "seeds_needed", "evidence", "rule"])
        for x in found:
            d = x.decision
            writer.writerow([x.claim, x.paper, x.scope, x.view or "", x.verdict, x.prompts, *(
                [d.seeds, _str(d.d.mean), _str(d.d.se), _str(d.critical), d.pending, _str(d.detectable)] if d else [""] * 6),
                _str(x.paper_diff), "" if d is None or d.seeds_needed is None else d.seeds_needed, x.evidence, x.rule])


def _main_section(r: Report, sweep: Sweep, found: list[claims.Finding]) -> None:
    algos = sweep.values("algo")
    r.text(f"## Main table: the {len(algos)} algorithms at 50 % KV compression",
           "Mean ± standard error over seeds (n with results; collapsed runs among them; failed runs apart, counted as 0 by the "
           "verdicts). The paper's column is its GSM8K accuracy with Qwen3-4B "
           "(a different model and task: the order, not the scale, is what compares).")
    ours = [f for f in found if f.pair != ("", "")]
    if len(algos) > 2:
        tables_ = tables.corrections(ours, sweep)
        r.text("### The rollout corrections against dense and against SMD",
               f"Does each algorithm trained under eviction recover the dense learner's held-out result (it matches dense within "
               f"{claims.MARGIN}, the rule of 'a matches b')? And does SMD beat it (a > b)? Verdict (paired difference ± se, seeds), "
               "by the rules above:")
        r.table("corrections_vs_dense", *tables_["recover_dense"])
        r.table("corrections_vs_smd", *tables_["smd_against"])
        r.text("Which recover the dense learner's result, per task and evaluation:", *(f"- {line}" for line in tables.recover_sentences(ours)))
    tasks = sweep.values("task") if "task" in sweep.keys else [None]
    for task in tasks:
        t = {"task": task} if task else {}
        label = f"task {task}" if task else "the main table"
        r.text(f"### {'task ' + task if task else 'main table'}")
        r.table(f"main_{task or 'table'}", *tables.main_rows(sweep, t))
        header, rows = tables.correction_fractions(sweep, t)
        if rows:
            r.text("What each correction masked, rejected or truncated, per training step (mean over the steps of a run):")
            r.table(f"corrections_{task or 'main'}", header, rows)
        header, rows, notes = tables.per_seed(sweep, t)
        if rows:
            r.text(f"Per seed: the warm start of {label} (held-out under eviction before any GRPO step, and the answer-bearing KV "
                   "its eviction kept) beside each algorithm's held-out reward under eviction after training (the answer KV kept "
                   "then; † collapsed). Read across a row: what the seed's warm start keeps of the evidence under eviction, and "
                   "what each algorithm reaches from it.")
            r.table(f"seeds_{task or 'main'}", header, rows)
            r.text(*notes)
            r.figure(figures.seeds_scatter(sweep, task, r.out), f"warm start against result per seed, {label}")
        r.figure(figures.training_curves(sweep, task, r.out), f"training curves, {label}")
        if layers := _layers(sweep):
            r.figure(figures.evidence_curves(sweep, task, layers, r.out), f"answer-bearing KV kept, {label}")


def _layers(sweep: Sweep) -> int:
    """Layers with an answer-bearing-KV diagnostic in the runs' metrics (0: none, e.g. a dense run or a paper task)."""
    return max((len([k for k in r.steps()[0] if k.startswith("evidence/kept_l")]) for r in sweep.runs if r.ok and r.steps()), default=0)


def _ablation_section(r: Report, sweep: Sweep, title: str, x_key: str, plot) -> None:
    r.text(f"## {title}", f"`smd ablate +recipe={sweep.name}`; mean ± standard error over seeds (n with results; collapsed "
           "runs among them; failed runs apart).")
    series = sweep.values("algo") if "algo" in sweep.keys else [None]
    rows = []
    for x in sweep.values(x_key):
        for algo in series:
            a = {"algo": algo} if algo else {}
            cells = [sweep.cell(m, **a, **{x_key: x}) for _, m in ABLATION_COLUMNS]
            rows.append([x, *([algo] if algo else []), *tables.counts(sweep.select(**a, **{x_key: x})), *map(str, cells)])
    r.table(sweep.name, [x_key, *(["algo"] if series != [None] else []), *tables.COUNTS, *(h for h, _ in ABLATION_COLUMNS)], rows)
    r.figure(plot(sweep, x_key, r.out, sweep.name), title)


def _parity_section(r: Report, check: dict | None) -> None:
    if not check or not check.get("policies"):
        return
    r.text("## Parity: the lr = 0 protocol, float32 and float64",
           f"`smd check-parity`: {next(iter(check['policies'].values())).get('rows', '?')} rollouts of task {check.get('task', '?')} (seed "
           f"{check.get('seed', '?')}'s warm start) per eviction policy at c = {check.get('compression', '?')}, scored by the learner at "
           "the sampler's own weights in each view, and by the shadow replay with the model in float64 (float32 rounding gone "
           "from the learner's side: a mask error survives it, rounding does not). Largest |log p_view - log p_sampler|:")
    rows = []
    for name, p in check["policies"].items():
        v = p.get("views", {})
        rows.append([name, *(f"{v[k]['max_abs_diff']:.2g}" if k in v else "-" for k in ("shadow", "physical", "shadow_float64")),
                     f"{v['shadow_float64']['rounding']:.2g}" if "shadow_float64" in v else "-",
                     f"{v['dense']['mean_abs_diff']:.3g}" if "dense" in v else "-", "yes" if p.get("passed") else "no", p.get("verdict", "")])
    r.table("parity", ["policy", "shadow (float32)", "physical", "shadow, float64", "float32 rounding", "dense learner's mean",
                       "passed", "verdict"], rows)


def _memory_section(r: Report, bench: dict | None) -> None:
    if not bench:
        return
    size, mib = bench["size"], 2.0**20
    model = f"{size['weights']}, " if size.get("weights") else ""
    r.text("## Learner memory", f"`python bench/learner_memory.py` on {bench['device']}: {model}{size['layers']} layers x {size['hidden']}, "
           f"vocab {size['vocab']}, {size['rows']} sequences of P {size['prompt']} + R {size['response']}, SnapKV at 50 % "
           f"(kept {bench['kept_fraction']:.2f}). Dynamic = peak live tensor bytes of one learner step above what was held "
           "before it; static = weights, gradients, optimizer state (and Sparse-RL's frozen reference model). The paper: SMD "
           "100 %, Sparse-RL 150 % of the baseline's VRAM.")
    rows = [[name, f"{a['dynamic_peak_bytes'] / mib:.1f}", f"{a['static_bytes'] / mib:.1f}", f"{a['dynamic_over_naive_sparse']:.3f}",
             f"{a['total_over_naive_sparse']:.3f}"] for name, a in bench["algorithms"].items()]
    r.table("memory_learner", ["algorithm", "dynamic MiB", "static MiB", "dynamic / naive_sparse", "total / naive_sparse"], rows)
    r.text("One forward + backward of each learner view on the same batch (physical eviction: re-run the prefill, evict by "
           "slicing, teacher-force the response):")
    r.table("memory_views", ["rollout", "view", "peak MiB", "/ dense"],
            [[policy, name, f"{v['peak_bytes'] / mib:.1f}", f"{v['over_dense']:.3f}"]
             for policy, per_view in bench["views"].items() for name, v in per_view.items()])


def _overhead_section(r: Report, benches: list[dict]) -> None:
    if not benches:
        return
    r.text("## Step-time overhead", "`python bench/step_overhead.py --algos ...`: each algorithm's step (rollout + learner) "
           "on the same batch, interleaved round by round; medians and each round's ratio to naive_sparse. With G rows per "
           "prompt (GRPO's shape) the prefill and the learner compute each prompt once, so the response rows, where SMD's "
           "teacher and KL add their work, weigh more.")
    rows = []
    for b in benches:
        size = machinery.overhead_size(b)
        for name, median in b["median_seconds"].items():
            rounds = cell(b["rounds_over_naive_sparse"][name])
            rows.append([size, name, f"{median:.3f}", f"{b['over_naive_sparse'][name]:.3f}", str(rounds)])
    r.table("overhead", ["size", "algorithm", "median step s", "/ naive_sparse (medians)", "/ naive_sparse (rounds, mean ± se)"], rows)


def _runs_csv(out: Path, sweeps: dict[str, Sweep]) -> None:
    keys = sorted({k for s in sweeps.values() for k in s.keys})
    metrics = sorted({m for _, m in MAIN_COLUMNS + ABLATION_COLUMNS} | {"eval/reward_before", "eval/evict/reward_before",
                                                                         "eval/evict/kept_before", "train/seconds"})
    with atomic_text(out / "runs.csv") as f:
        writer = csv.writer(f)
        writer.writerow(["sweep", *keys, "status", "reason", *metrics, "dir"])
        for s in sweeps.values():
            for run in s.runs:
                if run.attempted:
                    writer.writerow([s.name, *(run.values.get(k, "") for k in keys), run.status, run.error or "",
                                     *(_str(run.metric(m)) if run.ok else "" for m in metrics), run.dir.name])
