"""`smd reproduce` (= `make reproduce`): the tables' recipes and the runs they share, the claims' verdicts on data made
to order, the paper scale's plan and its clear stop without a GPU or the Hub, and the quick variant end to end."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.report import claims
from smd_cli.report.data import Sweep
from smd_cli.report.write import write_report
from smd_cli.stages.sweep import distinct, plan
from smd_cli.stats import FAILS, HOLDS, INCONCLUSIVE

ROOT = Path(__file__).resolve().parents[1]


def members(recipe: str) -> list:
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("ablate", overrides=[f"+recipe={recipe}"])
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
    paper = [distinct(members(r)) for r in ("paper_main_table", "paper_ablate_compression", "paper_ablate_lambda", "paper_ablate_selection")]
    assert [len(p) for p in paper] == [4 * 8 * 3, 36, 15, 30]
    assert all(m.name.startswith(("gsm8k_", "tldr_", "govreport_", "hotpotqa_")) for p in paper for m in p)


def fake_sweep(tmp_path: Path, name: str, keys: list[str], runs: list[tuple[dict, dict]]) -> Sweep:
    """A sweep directory as `smd ablate` writes it, with each run's summary given."""
    rows = []
    for i, (values, summary) in enumerate(runs):
        run_dir = tmp_path / name / "runs" / f"run{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"status": "completed", **summary}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
        rows.append({**values, "status": "ok", "dir": str(run_dir)})
    (tmp_path / name / "summary.json").write_text(json.dumps({"runs": rows, "sweep": {k: [] for k in keys}}))
    return Sweep.read(name, tmp_path / name)


def test_claims_are_judged_by_their_rules(tmp_path):
    evict = {"dense": (0.30, 0.32, 0.31), "naive_sparse": (0.40, 0.44, 0.42), "sparse_rl": (0.41, 0.45, 0.37), "tis": (0.4, 0.4, 0.4),
             "smd": (0.70, 0.74, 0.72)}
    runs = [({"algo": a, "seed": str(s)}, {"eval/evict/reward_after": evict[a][s], "eval/reward_after": 0.9 + 0.01 * s})
            for a in evict for s in range(3)]
    main_ = fake_sweep(tmp_path, "main", ["algo", "seed"], runs)
    found = {(f.claim, f.view): f for f in claims.main_table(main_)}
    assert found[("SMD beats naive compression", "under eviction")].verdict == HOLDS  # paired d = 0.30, se = 0
    assert found[("SMD beats naive compression", "dense cache")].verdict == INCONCLUSIVE  # d = 0 exactly
    assert found[("Naive compression falls behind dense", "under eviction")].verdict == FAILS  # dense 0.31 < naive 0.42
    assert found[("SMD is near-lossless against dense at 50 % compression", "under eviction")].verdict == HOLDS
    assert "smd 0.720 ± 0.012 vs naive_sparse 0.420 ± 0.012; paired difference +0.300 ± 0.000 over 3 seeds" in \
        found[("SMD beats naive compression", "under eviction")].evidence
    lam = fake_sweep(tmp_path, "lambda", ["lambda", "seed"], [({"lambda": lv, "seed": str(s)}, {"eval/evict/reward_after": m + 0.01 * s,
                                                                                               "eval/reward_after": 0.5})
                                                               for lv, m in (("0", 0.5), ("0.1", 0.7), ("0.8", 0.4)) for s in range(3)])
    best = {f.view: f for f in claims.lambda_best(lam) if f.claim.startswith("lambda = 0.1 is")}
    assert best["under eviction"].verdict == HOLDS and best["dense cache"].verdict == INCONCLUSIVE
    memory = {"size": {"layers": 2, "hidden": 64, "vocab": 541}, "device": "cpu",
              "algorithms": {"smd": {"dynamic_over_naive_sparse": 1.02}, "sparse_rl": {"total_over_naive_sparse": 1.01}},
              "views": {"snapkv": {"physical": {"over_dense": 1.4}, "shadow": {"over_dense": 1.01}}}}
    assert [f.verdict for f in claims.memory(memory)] == [HOLDS, FAILS, HOLDS]
    report = write_report(tmp_path / "report", {"main": main_, "lambda": lam}, {"learner_memory": None, "step_overhead": []},
                          {"scale": "tiny", "commit": "abc"})
    text = report.read_text()
    assert "| smd | 3 | 0.910 ± 0.0058 | 0.720 ± 0.012 |" in text and "**holds** (smd 0.720 ± 0.012 vs naive_sparse" in text
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
                    "## Distillation weight (lambda) ablation", "## Token-selection ablation", "## Learner memory", "## Step-time overhead"):
        assert section in report
    assert "11 training runs for 17 table entries" in report and "**Quick check**" in report
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert len(runs) == 17 and len({r["dir"] for r in runs}) == 11 and all(r["status"] == "ok" for r in runs)
    smd = [r for r in runs if r["sweep"] == "main_table" and r["algo"] == "smd"]
    summary = json.loads((root / "members" / smd[0]["dir"] / "summary.json").read_text())
    main_rows = {r["algo"]: r for r in csv.DictReader((out / "main_vote.csv").open())}
    assert float(main_rows["smd"]["held-out, under eviction"]) == pytest.approx(summary["eval/evict/reward_after"], abs=5e-4)
    worst = max(json.loads((root / "members" / r["dir"] / "summary.json").read_text())["train/mismatch/max_abs_diff_max"]
                for r in runs if r.get("algo", "smd") in ("smd", ""))
    machinery = {r["claim"]: r for r in csv.DictReader((out / "claims_machinery.csv").open())}
    parity = machinery["The shadow mask makes the learner's policy the sampler's"]
    assert parity["verdict"] == ("**holds**" if worst <= 1e-5 else "**does not hold**")
    for png in ("curves_vote.png", "evidence_vote.png", "ablate_compression.png", "ablate_lambda.png", "ablate_selection.png"):
        assert (out / png).stat().st_size > 10_000
