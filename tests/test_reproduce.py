"""`smd reproduce` (= `make reproduce`): the tables' recipes and the runs they share, the claims' verdicts on data made
to order, the paper scale's plan and its clear stop without a GPU or the Hub, and the quick variant end to end."""

import csv
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.report import budget, claims, machinery
from smd_cli.report.data import Sweep
from smd_cli.report.stats import FAILS, HOLDS, INCONCLUSIVE, Sequential
from smd_cli.report.write import write_report
from smd_cli.runs.sweep import distinct, plan

ROOT = Path(__file__).resolve().parents[1]


def members(recipe: str, *ablate: str) -> list:
    """The recipe's sweep members, composed; `ablate`: overrides of the sweep itself (ablate.subset=...)."""
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("ablate", overrides=[f"+recipe={recipe}", *ablate])
        return plan(cfg, [f"+recipe={recipe}"])[1]


def test_the_tables_recipes_share_their_common_runs():
    """Each table's sweep as the paper asks (values by hand); a run two tables share composes to the same config."""
    main_, comp, lam, sel = (distinct(members(r)) for r in ("main_table", "ablate_compression", "ablate_lambda", "ablate_selection"))
    assert (len(main_), len(comp), len(lam), len(sel)) == (2 * 8 * 3, 4 * 3 * 3, 5 * 3, 5 * 2 * 3)
    main_ids = {m.identity for m in main_}
    shared = {"compression": {m.label for m in comp if m.identity in main_ids}, "lambda": {m.label for m in lam if m.identity in main_ids},
              "selection": {m.label for m in sel if m.identity in main_ids}}
    assert shared["compression"] == {f"compression=0.5,algo={a},seed={s}" for a in ("naive_sparse", "sparse_rl", "smd") for s in "012"}
    assert shared["lambda"] == {f"lambda=0.1,seed={s}" for s in "012"}
    assert shared["selection"] == {f"eviction=snapkv,algo={a},seed={s}" for a in ("naive_sparse", "smd") for s in "012"}
    total = len({m.identity for group in (main_, comp, lam, sel) for m in group})
    assert total == 48 + (36 - 9) + (15 - 3) + (30 - 6)
    # the paper scale's tables (their sizes: test_paper_scale_prints_its_plan_and_stops_without_a_gpu_or_the_hub), one seed
    paper = [distinct(members(r, "ablate.subset=['seed=0']")) for r in ("paper_main_table", "paper_ablate_compression", "paper_ablate_lambda",
                                                                        "paper_ablate_selection")]
    assert [len(p) for p in paper] == [4 * 8, 12, 5, 10]
    assert all(m.name.startswith(("gsm8k_", "tldr_", "govreport_", "hotpotqa_")) for p in paper for m in p)


FAKE_CONFIG = {"steps": 2, "lambda": 0.1, "compression": 0.5, "optim": {"lr": 1e-5}, "model": {"name": "tiny"},
               "grpo": {"prompts_per_step": 2, "num_generations": 4, "epsilon": 0.2, "loss_agg": "token-mean"},
               "eval": {"num_prompts": 128, "prompts": "per_seed", "temperature": 1.0, "dense_eviction": "snapkv"},
               "task": {"_target_": "smd_cli.tasks.synthetic.NeedleRetrieval", "prompt_tokens": 48, "max_new_tokens": 8}}


def fake_sweep(tmp_path: Path, name: str, keys: list[str], runs: list[tuple[dict, dict]], steps: list[dict] | None = None) -> Sweep:
    """A sweep directory as `smd ablate` writes it, with each run's summary given (its `status` "collapsed" or
    "failed ..." when the summary says so), `steps` as every run's metrics.jsonl, and a config.json of 128 held-out prompts."""
    rows = []
    for i, (values, summary) in enumerate(runs):
        run_dir = tmp_path / name / "runs" / f"run{i}"
        run_dir.mkdir(parents=True)
        status = summary.get("status", "completed")
        (run_dir / "summary.json").write_text(json.dumps({"status": status, **summary}))
        (run_dir / "config.json").write_text(json.dumps(FAKE_CONFIG))  # the report's setup; the verdicts' resolution: 1/128
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps or [{"step": 1, "reward": 0.5}]))
        rows.append({**values, "status": {"completed": "ok"}.get(status, status), "dir": str(run_dir),
                     "status_reason": summary.get("status_reason"), "error": summary.get("error")})
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / name / "summary.json").write_text(json.dumps({"runs": rows, "sweep": {k: [] for k in keys}}))
    return Sweep.read(name, tmp_path / name)


def test_claims_are_judged_by_their_rules(tmp_path):
    evict = {"dense": (0.30, 0.32, 0.31), "naive_sparse": (0.40, 0.44, 0.42), "sparse_rl": (0.41, 0.45, 0.37), "tis": (0.4, 0.4, 0.4),
             "smd": (0.70, 0.74, 0.72)}
    runs = [({"algo": a, "seed": str(s)}, {"eval/evict/reward_after": evict[a][s], "eval/reward_after": 0.9 + 0.01 * s})
            for a in evict for s in range(3)]
    main_ = fake_sweep(tmp_path, "main", ["algo", "seed"], runs)
    found = {(f.claim, f.view): f for f in claims.main_table(main_, Sequential((3,)))}
    assert found[("SMD beats naive compression", "under eviction")].verdict == HOLDS  # d = 0.30, se 0 floored: (1/128) / sqrt 3
    assert found[("SMD beats naive compression", "dense cache")].verdict == INCONCLUSIVE  # d = 0 exactly
    assert found[("Naive compression falls behind dense", "under eviction")].verdict == FAILS  # dense 0.31 < naive 0.42
    assert found[("SMD is near-lossless against dense at 50 % compression", "under eviction")].verdict == HOLDS
    assert "smd 0.720 ± 0.012 vs naive_sparse 0.420 ± 0.012; paired difference +0.300 ± 0.000 over 3 seeds" in \
        found[("SMD beats naive compression", "under eviction")].evidence
    lam = fake_sweep(tmp_path, "lambda", ["lambda", "seed"], [({"lambda": lv, "seed": str(s)}, {"eval/evict/reward_after": m + 0.01 * s,
                                                                                               "eval/reward_after": 0.5})
                                                               for lv, m in (("0", 0.5), ("0.1", 0.7), ("0.8", 0.4)) for s in range(3)])
    best = {f.view: f for f in claims.lambda_best(lam, Sequential((3,))) if f.claim.startswith("lambda = 0.1 is")}
    assert best["under eviction"].verdict == HOLDS and best["dense cache"].verdict == INCONCLUSIVE
    memory = {"size": {"layers": 2, "hidden": 64, "vocab": 541}, "device": "cpu",
              "algorithms": {"smd": {"dynamic_over_naive_sparse": 1.02}, "sparse_rl": {"total_over_naive_sparse": 1.01}},
              "views": {"snapkv": {"physical": {"over_dense": 1.4}, "shadow": {"over_dense": 1.01}}}}
    assert [f.verdict for f in machinery.memory(memory)] == [HOLDS, FAILS, HOLDS]
    assert machinery.memory(memory)[0].scope == "2 layers x 64, vocab 541, cpu"
    memory["size"] |= {"model": "smollm2_135m", "layers": 30, "hidden": 576, "vocab": 49152}  # bench/learner_memory.py --model
    assert machinery.memory(memory)[0].scope == "smollm2_135m: 30 layers x 576, vocab 49152, cpu"
    report = write_report(tmp_path / "report", {"main": main_, "lambda": lam}, {"learner_memory": None, "step_overhead": []},
                          {"scale": "tiny", "commit": "abc"})
    text = report.read_text()
    assert "| smd | 3 | 0 | 0 | 0.910 ± 0.0058 | 0.720 ± 0.012 |" in text and "**holds** (smd 0.720 ± 0.012 vs naive_sparse" in text
    assert {r["verdict"] for r in csv.DictReader((tmp_path / "report" / "claims_machinery.csv").open())} == {"**not measured**"}


@pytest.mark.slow
def test_paper_scale_prints_its_plan_and_stops_without_a_gpu_or_the_hub(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present: the paper scale would start")
    with pytest.raises(SystemExit) as done:
        main(["reproduce", "paper=true", f"root={tmp_path / 'root'}", f"out={tmp_path / 'report'}"])
    assert done.value.code == 2
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "smd reproduce, paper scale: what will run" in text and "159 distinct training runs, 159 to run" in text
    for table, recipe, runs, shared in (("main", "paper_main_table", 4 * 8 * 3, 0), ("compression", "paper_ablate_compression", 36, 9),
                                        ("lambda", "paper_ablate_lambda", 15, 3), ("selection", "paper_ablate_selection", 30, 6)):
        assert f"│ {table} │ {recipe} │ {runs} │ {shared} │ 0 │ {runs - shared} │" in text, table  # runs, shared, finished, to run
    assert "make reproduce SCALE=paper stops here. It needs a CUDA GPU" in text
    assert ("the Hugging Face Hub's model Qwen/Qwen3-4B-Instruct-2507, dataset openai/gsm8k, dataset trl-lib/tldr, dataset "
            "ccdv/govreport-summarization, dataset hotpotqa/hotpot_qa: not in the local cache, and HF_HUB_OFFLINE=1 is set") in text
    assert not (tmp_path / "root" / "members").exists()


@pytest.mark.slow
def test_quick_reproduce_end_to_end(tmp_path):
    """`make reproduce QUICK=1`: every table, the benchmarks and the report, minutes on two cores. Checked here from the
    runs' own files: the table cells, the parity verdict, the shared runs."""
    env = {**os.environ, "SMD_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    root, out = tmp_path / "root", tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "smd_cli.cli", "reproduce", "quick=true", f"root={root}", f"out={out}"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "REPORT.md").read_text()
    for section in ("## The paper's claims, judged from the data", "## Main table", "## Compression ablation",
                    "## Distillation weight (lambda) ablation", "## Token-selection ablation", "## Parity: the lr = 0 protocol, float32 and float64",
                    "## Learner memory", "## Step-time overhead"):
        assert section in report
    assert "11 training runs for 17 table entries" in report and "**Quick check**" in report
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert len(runs) == 17 and len({r["dir"] for r in runs}) == 11 and all(r["status"] == "ok" for r in runs)
    smd = [r for r in runs if r["sweep"] == "main_table" and r["algo"] == "smd"]
    summary = json.loads((root / "members" / smd[0]["dir"] / "summary.json").read_text())
    main_rows = {r["algo"]: r for r in csv.DictReader((out / "main_vote.csv").open())}
    assert float(main_rows["smd"]["held-out, under eviction"]) == pytest.approx(summary["eval/evict/reward_after"], abs=5e-4)
    check = json.loads((root / "bench" / "check_parity" / "parity.json").read_text())  # smd check-parity on the quick warm start
    wrong = [p for p, r in check["policies"].items() if "shadow_float64" in r["failed"]]
    wide = max(r["views"]["shadow_float64"]["max_abs_diff"] for r in check["policies"].values())
    machinery_ = {r["claim"]: r for r in csv.DictReader((out / "claims_machinery.csv").open())}
    parity = machinery_["The shadow mask makes the learner's policy the sampler's"]
    assert parity["verdict"] == ("**does not hold**" if wrong else "**holds**") and f"in float64 up to {wide:.2g}" in parity["evidence"]
    verdicts = list(csv.DictReader((out / "claims.csv").open()))
    assert verdicts and all(v["verdict"] not in (HOLDS, FAILS) for v in verdicts if v["seeds"])  # one seed decides nothing
    # (inconclusive, or uninformative where every run of both cells sits at the reward's bound)
    seeds = list(csv.DictReader((out / "seeds_vote.csv").open()))  # each seed's warm start beside every algorithm
    assert len(seeds) == 1 and float(seeds[0]["warm start: answer KV kept"]) == pytest.approx(summary["eval/evict/kept_before"], abs=5e-3)
    for png in ("curves_vote.png", "evidence_vote.png", "seeds_vote.png", "ablate_compression.png", "ablate_lambda.png", "ablate_selection.png"):
        assert (out / png).stat().st_size > 10_000


TABLE_KEYS = {"main_table": {"task": ["vote"], "algo": ["dense", "naive_sparse", "tis", "smd"]}, "ablate_lambda": {"lambda": ["0", "0.1", "0.8"]}}
MEANS = {  # (dense cache, under eviction) held-out reward of each cell; every seed adds its warm start's w_s (up to 0.2 + 0.02
    # of noise: every value stays in a reward's [0, 1], which `smd_cli.runtime.records` checks)
    "dense": (0.70, 0.30), "naive_sparse": (0.70, 0.40), "tis": (0.30, 0.10), "smd": (0.70, 0.70), "0": (0.4, 0.4), "0.1": (0.7, 0.7),
    "0.8": (0.3, 0.3)}


def fake_ablate(root: Path, calls: list):
    """Stands in for `smd reproduce`'s `smd ablate` subprocess: writes each asked member's run (its held-out reward from
    MEANS, a warm-start effect per seed and a small deterministic noise) and the sweep's summary.json."""
    def run(command: list[str]) -> int:
        args = dict(a.split("=", 1) for a in command[4:] if "=" in a)
        recipe = args["+recipe"]
        swept = {**TABLE_KEYS[recipe], "seed": ["0", "1", "2"]}
        swept.update({k: v.split(",") for k, v in args.items() if k in swept})
        calls.append((recipe, {k: v for k, v in args.items() if k in swept}))
        rows = []
        for combo in itertools.product(*swept.values()):
            values = dict(zip(swept, combo))
            cell, seed = values.get("algo", values.get("lambda")), int(values["seed"])
            noise = random.Random(f"{cell}/{seed}").uniform(-0.02, 0.02)
            run_dir = root / "members" / "_".join(f"{k}{v}" for k, v in values.items())
            run_dir.mkdir(parents=True, exist_ok=True)
            dense, evict = (m + 0.1 * (seed % 3) + noise for m in MEANS[cell])
            (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "eval/reward_after": dense,
                                                              "eval/evict/reward_after": evict}))
            rows.append({**values, "status": "ok", "dir": str(run_dir)})
        where = Path(args["hydra.run.dir"])
        where.mkdir(parents=True, exist_ok=True)
        (where / "summary.json").write_text(json.dumps({"runs": rows, "sweep": swept}))
        return 0
    return run


def test_seeds_are_added_until_decided(tmp_path, monkeypatch):
    """`make reproduce`'s rounds, with `smd ablate` faked: every cell of an undecided claim gets the next look's seeds
    (one invocation per table, its values swept), a cell whose claims are all decided gets none, and the rounds stop
    at the cap; run again, nothing new is asked."""
    from omegaconf import OmegaConf

    from smd_cli.stages import reproduce

    root, calls = tmp_path / "root", []
    monkeypatch.setattr(reproduce, "run_logged", fake_ablate(root, calls))
    cfg = OmegaConf.create({"quick": False, "jobs": 2, "quick_overrides": {"tiny": []}})
    tables, rule = {"main": "main_table", "lambda": "ablate_lambda"}, Sequential((3, 5, 8))
    task = reproduce.Task("tiny", (), tables, root, tmp_path / "out", None)
    for recipe in tables.values():
        reproduce.run_logged(reproduce.ablate_command(cfg, "tiny", recipe, task, root / "sweeps" / recipe))
    added, rounds = reproduce.add_seeds(cfg, "tiny", task, rule)
    asked = calls[2:]
    # look 1 (c = 7.20) decides every claim on tis (far below the others) and on lambda, and the large differences under
    # eviction; the near-lossless claim with a dense cache goes on to look 2, the ties of the dense cache to the cap
    assert asked == [("main_table", {"task": "vote", "algo": "dense,naive_sparse,smd", "seed": "3,4"}),
                     ("main_table", {"task": "vote", "algo": "dense,naive_sparse,smd", "seed": "5,6,7"})]
    assert added == 3 * 2 + 3 * 3
    assert rounds.startswith("to 5 seeds: 6 table entries") and "to 8 seeds: 9 table entries" in rounds
    sweeps = reproduce.read_tables(tables, root)
    found = {(f.claim, f.view): f for f in claims.policies(sweeps, rule)}
    beats = found[("SMD beats naive compression", "under eviction")]
    assert (beats.verdict, beats.decision.seeds) == (HOLDS, 3)  # d = 0.3 at look 1 (was look 2: c = 44.5); seeds 3-7 ran for others
    assert found[("SMD is near-lossless against dense at 50 % compression", "dense cache")].decision.seeds == 5
    tie = found[("SMD beats naive compression", "dense cache")]
    assert (tie.verdict, tie.decision.seeds, tie.pending) == (INCONCLUSIVE, 8, False)
    assert tie.decision.detectable > 0 and "smallest difference detectable at the cap" in tie.evidence and "+0.093" in tie.evidence
    assert found[("lambda = 0.1 is the best distillation weight", "under eviction")].verdict == HOLDS
    assert reproduce.add_seeds(cfg, "tiny", task, rule)[0] == 0 and len(calls) == 4  # nothing left to ask


def test_every_correction_is_judged_against_smd_and_dense_and_collapsed_runs_are_flagged(tmp_path):
    """Rows beyond the paper's (mis, icepop, trm) get the same paired verdicts, as soon as their runs exist; a collapsed
    run enters the means and verdicts with its numbers and is flagged in the main table, the per-seed table and runs.csv."""
    evict = {"dense": 0.6, "naive_sparse": 0.3, "mis": 0.31, "icepop": 0.6, "trm": 0.2, "smd": 0.62}
    runs = []
    for a, m in evict.items():
        for s in range(3):
            summary = {"eval/evict/reward_after": m + 0.05 * s + 0.001 * len(a) * s, "eval/reward_after": 0.9,
                       "eval/evict/kept_before": 0.2 + 0.3 * s, "eval/evict/reward_before": 0.1 + 0.2 * s, "eval/evict/kept_after": 0.5}
            if (a, s) == ("trm", 2):
                summary.update(status="collapsed", status_reason="reward 0 over the last 10 steps")
            runs.append(({"algo": a, "seed": str(s)}, summary))
    main_ = fake_sweep(tmp_path, "main", ["algo", "seed"], runs, steps=[{"step": 1, "reward": 0.5, "rollout_corr/masked_seq_frac": 0.25}])
    found = {(f.claim, f.view): f for f in claims.main_table(main_, Sequential((3,)))}
    assert found[("SMD beats MIS", "under eviction")].verdict == HOLDS and found[("SMD beats MIS", "under eviction")].group == "corrections"
    assert found[("IcePop recovers the dense learner's result", "under eviction")].verdict == HOLDS  # within 0.05 of dense
    assert found[("MIS recovers the dense learner's result", "under eviction")].verdict == FAILS  # 0.29 below dense
    assert found[("TRM recovers the dense learner's result", "under eviction")].decision.d.n == 3  # its collapsed seed counts
    report = write_report(tmp_path / "report", {"main": main_}, {}, {"scale": "tiny"}).read_text()
    assert "| trm | 3 | 1 | 0 |" in report and " †" in report  # n, collapsed, failed
    assert "- main table, under eviction: recover: smd, icepop; do not: naive_sparse, mis, trm" in report
    assert "| mis | rollout_corr/masked_seq_frac | 0.250 ± 0.000 |" in report
    rows = {(r["algo"], r["seed"]): r for r in csv.DictReader((tmp_path / "report" / "runs.csv").open())}
    assert (rows[("trm", "2")]["status"], rows[("trm", "2")]["reason"]) == ("collapsed", "reward 0 over the last 10 steps")
    seeds = list(csv.DictReader((tmp_path / "report" / "seeds_main.csv").open()))
    assert seeds[2]["trm"].endswith("†") and seeds[0]["warm start: answer KV kept"] == "0.2"
    assert "correlate with r = +1.00" in report  # the warm start's kept evidence and the seed's mean result
    tldr = fake_sweep(tmp_path, "paper", ["task", "algo", "seed"], [({"task": "tldr", "algo": a, "seed": str(s)}, {"eval/reward_after": r + 0.01 * s})
                                                                   for a, r in (("dense", 0.2), ("smd", 0.3)) for s in range(3)])
    rouge = [f for f in claims.main_table(tldr, Sequential((3,))) if f.claim == "SMD beats dense in ROUGE-L on TL;DR"]
    assert rouge[0].verdict == HOLDS and rouge[0].paper_diff is None and machinery.tldr(["tldr"]) == []


def test_parity_is_judged_in_float64_when_measured(tmp_path):
    """The parity claim reads `smd check-parity`'s float64 replay (rounding left aside, a mask error stands out); with no
    such check it falls back to the runs' float32 bound; SMD runs without per-step metrics do not crash it (they did:
    `f"{None:.2g}"`)."""
    smd = [({"algo": "smd", "seed": str(s)}, {"train/mismatch/max_abs_diff_max": 1.3e-5}) for s in range(2)]
    sweep = fake_sweep(tmp_path, "main", ["algo", "seed"], smd, steps=[{"step": 1}])  # no mismatch/mean_abs_diff per step
    [finding] = machinery.parity([sweep], None)
    assert finding.verdict == FAILS and "1.3e-05" in finding.evidence  # float32 alone: 1.3e-5 > 1e-5
    assert "every step of 2 SMD runs" in machinery.parity([sweep, sweep], None)[0].evidence  # tables sharing a run: counted once

    def view(value, rounding=None):
        return {"max_abs_diff": value, "mean_abs_diff": value / 10, **({} if rounding is None else {"rounding": rounding})}

    check = {"bound": 1e-5, "policies": {p: {"views": {"shadow": view(1.3e-5), "dense": view(0.2), "shadow_float64": view(1.2e-5, 9e-6)},
                                             "failed": ["shadow"], "passed": False} for p in ("snapkv", "random")}}
    [finding] = machinery.parity([sweep], check)  # float32 over the bound, float64 within 10 x the rounding: rounding
    assert finding.verdict == HOLDS and "in float32 up to 1.3e-05, in float64 up to 1.2e-05 (float32 rounding up to 9e-06)" in finding.evidence
    check["policies"]["random"]["failed"] = ["shadow", "shadow_float64"]  # a mask error: float64 misses the sampler too
    check["policies"]["random"]["views"]["shadow_float64"] = view(6.6, 9e-6)
    [finding] = machinery.parity([sweep], check)
    assert finding.verdict == FAILS and "a mask error under random" in finding.evidence
    assert machinery.parity([fake_sweep(tmp_path / "x", "main", ["algo", "seed"], [])], None) == []


def test_extensions_group_cells_into_few_invocations(tmp_path):
    """The seeds wanted become one `smd ablate` per table and seed range: values of the last key swept, one other key
    merged when its groups sweep the same values; a cell with every seed's results asks for nothing."""
    runs = [({"compression": c, "algo": a, "seed": str(s)}, {"eval/reward_after": 0.5}) for c in ("0.5", "0.7") for a in ("naive_sparse", "smd")
            for s in range(3)]
    comp = fake_sweep(tmp_path, "comp", ["compression", "algo", "seed"], runs)
    wanted = {("compression", (("algo", "smd"), ("compression", "0.7"))): 5, ("compression", (("algo", "smd"), ("compression", "0.5"))): 5,
              ("compression", (("algo", "naive_sparse"), ("compression", "0.7"))): 3}
    [e] = budget.extensions(wanted, {"compression": comp})
    assert e.overrides() == ["compression=0.5,0.7", "algo=smd", "seed=3,4"] and e.runs == 4 and e.label == "seeds3-4_0.5-0.7"
    planned = [budget.Planned("vote", str(s), 40, 256, 4, 700, ("vote", f"seed={s}")) for s in range(2)]
    cost = budget.Cost(run_s=6.5, step_s=0.36, eval_prompt_s=0.0036, warm_step_s=0.247)
    evaluations = 4 * 256 * 0.0036  # four evaluations of 256 prompts after training, four before (once per start)
    assert budget.predict(planned, cost, jobs=2) == pytest.approx((2 * (6.5 + 40 * 0.36 + evaluations) + 2 * evaluations + 2 * 700 * 0.247) / 2)
    shared = [budget.Planned("vote", "0", 40, 256, 4, 700, ("vote", "seed=0")) for _ in range(3)]  # three algorithms of one start
    assert budget.predict(shared, cost, jobs=1) == pytest.approx(3 * (6.5 + 40 * 0.36 + evaluations) + evaluations + 700 * 0.247)
    assert budget.renamed(("vote", "seed=2", "snapkv"), "2", "5") == ("vote", "seed=5", "snapkv")
    assert budget.renamed(("passkey", "", "snapkv"), "2", "5") == ("passkey", "", "snapkv")  # greedy, no warm start: no seed in it


@pytest.mark.slow
def test_dry_run_prints_the_cost_models_prediction(tmp_path, capsys):
    """`make reproduce ARGS=dry_run=true`: what would run and the cost model's minutes, worked out here by hand from the
    recipes (a run: start + 40 steps + 4 evaluations of 256 prompts after training, and 4 before once per starting point
    and evaluating eviction; a warm start per task and seed; two at once)."""
    from omegaconf import OmegaConf

    recipes = ROOT / "recipes"
    algos = OmegaConf.load(recipes / "main_table.yaml").ablate.sweep[1].split("=")[1].split(",")
    c = OmegaConf.load(ROOT / "conf" / "reproduce.yaml").cost.tiny
    run, before = c.run_s + 40 * c.step_s + 4 * 256 * c.eval_prompt_s, 4 * 256 * c.eval_prompt_s
    warm = 700 * c.warm_step_s
    base = 2 * len(algos) * 3 + (36 - 9) + (15 - 3) + (30 - 6)  # the tables' runs, those they share counted once
    cells = 2 * len(algos) + 2 + 4 + 3  # the claims' cells: the main table's, smd and sparse_rl at 0.7, 4 lambdas, 3 selections
    # evaluations before training, per seed's warm start: the main table's dense (under snapkv) and snapkv, per task; vote
    # at 0.3, 0.7 and 0.9; vote under recent, random, h2o and knorm (the lambdas share snapkv at 0.5) -> 4 + 3 + 4 = 11
    # a seed; the claims' cells at a new seed: 4 (main) + 1 (0.7) + 2 (recent and random) = 7
    now, worst = (base * run + 11 * 3 * before + 6 * warm) / 2, (cells * 5 * run + 7 * 5 * before + 2 * 5 * warm) / 2  # 5 seeds more, 2 tasks
    main(["reproduce", "dry_run=true", f"root={tmp_path / 'root'}"])
    text = " ".join(capsys.readouterr().out.split())
    rest = c.benchmarks_s + c.overhead_s
    assert (f"cost model: {base} runs now, {now / 60:.0f} min; if every claim stayed undecided to the cap of 8 seeds, {cells * 5} runs "
            f"more, {worst / 60:.0f} min; benchmarks and the rest {rest / 60:.0f} min: at most {(now + worst + rest) / 60:.0f} min") in text
    assert not (tmp_path / "root" / "members").exists()


def test_a_bad_sequential_rule_is_a_config_error(capsys):
    for bad, why in (("sequential.tiny.looks=[5,3]", "sequential.tiny.looks=[5, 3] is not allowed: a non-empty increasing list of "
                                                     "seed counts, e.g. [3, 5, 8]"),
                     ("sequential.tiny.alpha=0.7", "sequential.tiny.alpha=0.7 is not allowed: a one-sided error in (0, 0.5)")):
        with pytest.raises(SystemExit) as done:
            main(["reproduce", bad, "dry_run=true"])
        assert done.value.code == 2 and why in " ".join(capsys.readouterr().err.split())


def test_the_reports_records_are_kept_beside_it_in_the_runs_layout(tmp_path):
    """What the report reads besides the runs (benchmark and parity JSON, the invocations' times) is copied to OUT/records/
    in ROOT's layout, so that copying it back (with the members) makes `smd reproduce` skip every benchmark."""
    from smd_cli.stages import reproduce

    root, out = tmp_path / "root", tmp_path / "out"
    files = {"bench/learner_memory_0.json": "{}", "bench/check_parity/parity.json": '{"policies": {}}', "timing.json": "[]",
             "rounds.json": '["to 5 seeds"]', "members/x/summary.json": "{}"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    reproduce.keep_records(root, out)
    kept = sorted(str(p.relative_to(out / "records")) for p in (out / "records").rglob("*") if p.is_file())
    assert kept == ["bench/check_parity/parity.json", "bench/learner_memory_0.json", "timing.json"]  # rounds: recomputed from the runs
    assert (out / "records" / "bench" / "check_parity" / "parity.json").read_text() == '{"policies": {}}'
