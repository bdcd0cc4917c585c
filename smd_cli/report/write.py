"""`REPORT.md` with its CSVs and PNGs, from the sweeps of a reproduction and its benchmarks.

Every number in the report is computed here from what the runs and benchmarks wrote; the only numbers typed
in are the paper's own (`PAPER_GSM8K`, the claims' `paper` column), from `../shared/REFERENCES.md`.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from smd_cli.io import write_atomic
from smd_cli.report import claims, figures
from smd_cli.report.data import Sweep
from smd_cli.stats import cell

PAPER_GSM8K = {"dense": "74.5", "smd": "73.6", "sparse_rl": "71.2", "naive_sparse": "64.3"}  # accuracy %, Qwen3-4B, 50 %
MAIN_COLUMNS = [  # (header, metric)
    ("held-out, dense cache", "eval/reward_after"), ("held-out, under eviction", "eval/evict/reward_after"),
    ("greedy, dense cache", "eval/greedy_reward_after"), ("greedy, under eviction", "eval/evict/greedy_reward_after"),
    ("training reward (last 10 steps)", "steps:reward:last10"), ("max learner mismatch", "train/mismatch/max_abs_diff_max"),
    ("answer KV kept, training", "train/evidence/kept_mean"), ("answer KV kept, held-out after", "eval/evict/kept_after"),
]
ABLATION_COLUMNS = [("held-out, under eviction", "eval/evict/reward_after"), ("held-out, dense cache", "eval/reward_after"),
                    ("greedy, under eviction", "eval/evict/greedy_reward_after"), ("training reward (last 10)", "steps:reward:last10"),
                    ("answer KV kept, held-out after", "eval/evict/kept_after")]


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
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in cells]
        self.lines.append("")
        with (self.out / f"{name}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(cells)

    def figure(self, path: Path | None, caption: str) -> None:
        if path is not None:
            self.text(f"![{caption}]({path.name})")

    def save(self) -> Path:
        path = self.out / "REPORT.md"
        write_atomic(path, "\n".join(self.lines).rstrip() + "\n")
        return path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _str(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def write_report(out: Path, sweeps: dict[str, Sweep], bench: dict, header: dict) -> Path:
    """REPORT.md for the sweeps of roles `main`, `compression`, `lambda`, `selection` (any may be missing) and the
    benchmarks (`learner_memory`: one result, `step_overhead`: a list), under `header` (scale, commit, versions,
    machine, wall seconds, commands)."""
    out.mkdir(parents=True, exist_ok=True)
    r = Report(out)
    main = sweeps.get("main")
    r.text(f"# Reproduction report: Shadow Mask Distillation (arXiv 2605.06850), {header['scale']} scale")
    if header.get("quick"):
        r.text("**Quick check** (`QUICK=1`): one seed, two values per ablation, a few steps per run. It shows that the "
               "pipeline works end to end; its numbers prove nothing.")
    r.text(*_header(header, sweeps))
    r.text(*_setup(main or next(iter(sweeps.values()))))
    findings = _claims(sweeps, bench)
    r.text("## The paper's claims, judged from the data",
           "Each verdict is computed from the runs and benchmarks below by the rule beside it (`smd_cli/report/claims.py`, "
           "`smd_cli/stats.py`). Two cells are compared seed by seed: a seed's runs share their warm start, prompts and "
           "sampling seed, so d is the mean of the per-seed differences and se its standard error (the spread between warm "
           f"starts cancels out); margin {claims.MARGIN}; with one seed every comparison is inconclusive. A claim on the "
           "trained policies is judged once per held-out evaluation: with a dense KV cache, and under the run's eviction.")
    _claims_tables(r, findings)
    if main is not None:
        r.text("Which algorithms the main table separates (a > b holds), per task and evaluation:",
               *(f"- {line}" for line in claims.separation(main)))
        _main_section(r, main)
    for role, title, x_key, plot in (("compression", "Compression ablation", "compression", figures.ablation_lines),
                                     ("lambda", "Distillation weight (lambda) ablation", "lambda", figures.ablation_lines),
                                     ("selection", "Token-selection ablation", "eviction", figures.ablation_bars)):
        if role in sweeps:
            _ablation_section(r, sweeps[role], title, x_key, plot)
    _memory_section(r, bench.get("learner_memory"))
    _overhead_section(r, bench.get("step_overhead") or [])
    _runs_csv(out, sweeps)
    r.text("## Files", "`claims.csv`, one CSV per table above, `runs.csv` (every run of every sweep, per seed, with its "
           "directory), and the PNGs. The runs themselves (checkpoints, `metrics.jsonl`, `summary.json`) stay in the runs "
           f"directory: `{header.get('runs_dir', '-')}`.")
    return r.save()


def _header(header: dict, sweeps: dict[str, Sweep]) -> list[str]:
    versions = header.get("versions", {})
    runs = {r.dir for s in sweeps.values() for r in s.runs}
    listed = sum(len(s.runs) for s in sweeps.values())
    seeds = sorted({v for s in sweeps.values() for v in s.seeds()}, key=str)
    wall = header.get("wall_seconds")
    commits = sorted({_json(r.dir / "provenance.json").get("git_commit", "unknown") for s in sweeps.values() for r in s.runs if r.ok})
    return [
        f"Generated by `{header.get('command', 'smd reproduce')}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"- commit `{header.get('commit', 'unknown')}` (report); the runs ran at {', '.join(f'`{c}`' for c in commits) or '-'} "
        "(each run's provenance.json)",
        f"- python {versions.get('python', '?')}, torch {versions.get('torch', '?')}, "
        f"transformers {versions.get('transformers', '?')}, hydra-core {versions.get('hydra-core', '?')}",
        f"- machine: {header.get('machine', '?')}",
        f"- seeds: {', '.join(seeds) or '-'} (each seed its own warm start and sampling)",
        f"- {len(runs)} training runs for {listed} table entries (a run that several tables share ran once); "
        + (f"wall time of the invocation(s) that ran them, benchmarks included, {wall / 60:.1f} min" if isinstance(wall, (int, float))
           else "wall time not recorded"),
        f"- re-run: `{header.get('rerun', 'make reproduce')}`",
    ]


def _setup(sweep: Sweep) -> list[str]:
    """What every run did, read from one finished run's resolved config."""
    run = next((r for r in sweep.runs if r.ok and (r.dir / "config.json").is_file()), None)
    if run is None:
        return ["No run finished: nothing to report."]
    cfg = json.loads((run.dir / "config.json").read_text())
    g, m = cfg["grpo"], cfg["model"]
    arch = m.get("config") or {}
    model = (f"{m['name']} ({arch.get('num_hidden_layers', '?')} layers, hidden {arch.get('hidden_size', '?')}, "
             f"{arch.get('num_attention_heads', '?')} heads / {arch.get('num_key_value_heads', '?')} KV heads)")
    warm = m.get("warmstart") or {}
    return [
        "## Setup",
        f"Model {model}; {cfg['steps']} GRPO steps of {g['prompts_per_step']} prompts x {g['num_generations']} samples, "
        f"lr {cfg['optim']['lr']}, clip {g['epsilon']}, {g['loss_agg']}; SMD's lambda {cfg['lambda']} unless swept; "
        f"compression {cfg['compression']} unless swept."
        + (f" The tiny model is first warm-started by {warm['steps']} supervised steps (label smoothing "
           f"{warm.get('label_smoothing', 0)}), one warm start per seed." if warm.get("steps") else ""),
        f"Held-out: {cfg['eval']['num_prompts']} test prompts, sampled at temperature {cfg['eval']['temperature']} (seeded) and "
        "greedy, each twice: with a dense KV cache, and under the run's eviction policy and compression (a dense run under "
        f"{cfg['eval']['dense_eviction']} at the same compression). The training reward is the sampler's own, under its "
        "eviction. 'answer KV kept' is the fraction of the answer-bearing prompt entries (the synthetic tasks' "
        "needle/marked values) that the eviction kept, over layers and KV heads.",
    ]


def _claims(sweeps: dict[str, Sweep], bench: dict) -> list[claims.Finding]:
    found = []
    if "main" in sweeps:
        found += claims.main_table(sweeps["main"])
    found += claims.parity(list(sweeps.values()))
    if "compression" in sweeps:
        found += claims.compression(sweeps["compression"])
    if "lambda" in sweeps:
        found += claims.lambda_best(sweeps["lambda"])
    if "selection" in sweeps:
        found += claims.selection(sweeps["selection"])
    found += claims.memory(bench.get("learner_memory"))
    found += claims.overhead(bench.get("step_overhead") or [])
    return found


def _claims_tables(r: Report, findings: list[claims.Finding]) -> None:
    """Claims on the trained policies (one column per held-out evaluation), then claims on the machinery."""
    policies: dict[tuple, dict] = {}
    for f in findings:
        if f.view is not None:
            policies.setdefault((f.claim, f.paper, f.scope, f.rule), {})[f.view] = f
    views = list(claims.VIEWS)
    r.table("claims_policies", ["claim", "paper", "scope", *(f"{v}: verdict (evidence)" for v in views), "rule"],
            [[claim, paper, scope, *(f"**{by[v].verdict}** ({by[v].evidence})" if v in by else "-" for v in views), rule]
             for (claim, paper, scope, rule), by in policies.items()])
    rest = [f for f in findings if f.view is None]
    if rest:
        r.table("claims_machinery", ["claim", "paper", "scope", "verdict", "evidence", "rule"],
                [[f.claim, f.paper, f.scope, f"**{f.verdict}**", f.evidence, f.rule] for f in rest])


def _main_section(r: Report, sweep: Sweep) -> None:
    r.text("## Main table: the five algorithms at 50 % KV compression",
           "Mean ± standard error over seeds (n finished). The paper's column is its GSM8K accuracy with Qwen3-4B "
           "(a different model and task: the order, not the scale, is what compares).")
    tasks = sweep.values("task") if "task" in sweep.keys else [None]
    for task in tasks:
        t = {"task": task} if task else {}
        first = sweep.values("algo")[0]  # the warm start and its evaluations are the same for every algorithm of a seed
        before = [sweep.cell(m.removesuffix("_after") + "_before", **t, algo=first) if m.endswith("_after") else None for _, m in MAIN_COLUMNS]
        rows = [["before training (warm start)", before[0].n, *("" if c is None else str(c) for c in before), ""]]
        for algo in sweep.values("algo"):
            cells = [sweep.cell(m, **t, algo=algo) for _, m in MAIN_COLUMNS]
            rows.append([algo, len([x for x in sweep.select(**t, algo=algo) if x.ok]), *map(str, cells), PAPER_GSM8K.get(algo, "-")])
        r.text(f"### {'task ' + task if task else 'main table'}")
        r.table(f"main_{task or 'table'}", ["algo", "n", *(h for h, _ in MAIN_COLUMNS), "paper (GSM8K %)"], rows)
        rejected = sweep.cell("steps:is/rejected_seq_frac:mean", **t, algo="sparse_rl")
        if rejected.mean is not None:
            r.text(f"Sparse-RL vetoed {rejected} of the sequences per step and masked "
                   f"{sweep.cell('steps:is/rejected_token_frac:mean', **t, algo='sparse_rl')} of the tokens.")
        r.figure(figures.training_curves(sweep, task, r.out), f"training curves, {task}")
        if layers := _layers(sweep):
            r.figure(figures.evidence_curves(sweep, task, layers, r.out), f"answer-bearing KV kept, {task}")
        _warm_starts(r, sweep, t, task)


def _layers(sweep: Sweep) -> int:
    """Layers with an answer-bearing-KV diagnostic in the runs' metrics (0: none, e.g. a dense run or a paper task)."""
    return max((len([k for k in r.steps()[0] if k.startswith("evidence/kept_l")]) for r in sweep.runs if r.ok and r.steps()), default=0)


def _warm_starts(r: Report, sweep: Sweep, t: dict, task) -> None:
    """The policy each seed starts from (before any GRPO step): how much the warm starts differ."""
    algo = sweep.values("algo")[0]
    rows = []
    for seed in sweep.seeds():
        run = next((x for x in sweep.select(**t, algo=algo, seed=seed) if x.ok), None)
        if run:
            s = run.summary
            rows.append([seed, s.get("eval/reward_before"), s.get("eval/evict/reward_before"), s.get("eval/greedy_reward_before"),
                         s.get("eval/evict/greedy_reward_before"), s.get("eval/evict/kept_before")])
    if rows:
        r.text(f"Warm starts of task {task} (one per seed; held-out before any GRPO step):")
        r.table(f"warm_starts_{task or 'main'}", ["seed", "dense cache", "under eviction", "greedy, dense", "greedy, under eviction",
                                                  "answer KV kept"], rows)


def _ablation_section(r: Report, sweep: Sweep, title: str, x_key: str, plot) -> None:
    r.text(f"## {title}", f"`smd ablate +recipe={sweep.name}`; mean ± standard error over seeds (n finished).")
    series = sweep.values("algo") if "algo" in sweep.keys else [None]
    rows = []
    for x in sweep.values(x_key):
        for algo in series:
            a = {"algo": algo} if algo else {}
            cells = [sweep.cell(m, **a, **{x_key: x}) for _, m in ABLATION_COLUMNS]
            rows.append([x, *([algo] if algo else []), max(c.n for c in cells), *map(str, cells)])
    r.table(sweep.name, [x_key, *(["algo"] if series != [None] else []), "n", *(h for h, _ in ABLATION_COLUMNS)], rows)
    r.figure(plot(sweep, x_key, r.out, sweep.name), title)


def _memory_section(r: Report, bench: dict | None) -> None:
    if not bench:
        return
    size, mib = bench["size"], 2.0**20
    r.text("## Learner memory", f"`python bench/learner_memory.py` on {bench['device']}: {size['layers']} layers x {size['hidden']}, "
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
        a = b["args"]
        size = f"{a['layers']} x {a['hidden']}, {a['rows']} x (P {a['prompt']} + R {a['response']}), " + \
            (f"{a['group']} rows per prompt" if a.get("group", 1) > 1 else "distinct prompts")
        for name, median in b["median_seconds"].items():
            rounds = cell(b["rounds_over_naive_sparse"][name])
            rows.append([size, name, f"{median:.3f}", f"{b['over_naive_sparse'][name]:.3f}", str(rounds)])
    r.table("overhead", ["size", "algorithm", "median step s", "/ naive_sparse (medians)", "/ naive_sparse (rounds, mean ± se)"], rows)


def _runs_csv(out: Path, sweeps: dict[str, Sweep]) -> None:
    keys = sorted({k for s in sweeps.values() for k in s.keys})
    metrics = sorted({m for _, m in MAIN_COLUMNS + ABLATION_COLUMNS} | {"eval/reward_before", "eval/evict/reward_before", "train/seconds"})
    with (out / "runs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sweep", *keys, "status", "error", *metrics, "dir"])
        for s in sweeps.values():
            for run in s.runs:
                writer.writerow([s.name, *(run.values.get(k, "") for k in keys), run.status, run.error or "",
                                 *(_str(run.metric(m)) if run.ok else "" for m in metrics), run.dir.name])
