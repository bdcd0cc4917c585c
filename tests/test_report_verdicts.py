"""The report's verdicts know the held-out reward they compare (DESIGN.md contract 6): a reward in [0, 1] averaged over
each run's `eval.num_prompts` held-out prompts. A comparison whose runs all sit at the ceiling says "uninformative
(ceiling)", never "holds" (the small reproduction's dense cache: 1.000 +- 0.000 in every arm, where "SMD is
near-lossless against dense" read "holds"), and a constant per-seed difference (se = 0) is judged against one prompt's
worth, not decided by its sign."""

import csv
import json
import math
from pathlib import Path

import pytest

from smd_cli.report import claims, machinery
from smd_cli.report.data import Sweep
from smd_cli.report.stats import CEILING, FAILS, HOLDS, INCONCLUSIVE, Sequential, t_quantile
from smd_cli.report.write import write_report
from tests.test_reproduce import FAKE_CONFIG, fake_sweep

# per seed: held-out reward under eviction (multiples of 1/16: 16 passkey prompts); with a dense cache every run answers all
EVICT = {"dense": (0.5, 0.5, 0.5625), "naive_sparse": (0.5, 0.5625, 0.4375), "sparse_rl": (0.6875, 0.75, 0.625),
         "smd": (0.75, 0.8125, 0.6875)}


def small_sweep(tmp_path, prompts: int = 16):
    runs = [({"algo": a, "seed": str(s)}, {"eval/evict/reward_after": EVICT[a][s], "eval/reward_after": 1.0})
            for a in EVICT for s in range(3)]
    sweep = fake_sweep(tmp_path, "main", ["algo", "seed"], runs)
    for run in sweep.runs:  # the runs' own config: their held-out prompts
        (run.dir / "config.json").write_text(json.dumps({**FAKE_CONFIG, "eval": {**FAKE_CONFIG["eval"], "num_prompts": prompts}}))
    return sweep


def test_a_ceiling_is_uninformative_and_one_prompt_is_the_least_spread(tmp_path):
    sweep = small_sweep(tmp_path)
    found = {(f.claim, f.view): f for f in claims.main_table(sweep, Sequential((3,)))}
    lossless = found[("SMD is near-lossless against dense at 50 % compression", "dense cache")]
    assert (lossless.verdict, lossless.pending) == (CEILING, False)  # was "holds": d = 0, se = 0, sign of d + 0.05
    assert "every run of both cells at the reward's ceiling (1) over 3 seeds" in lossless.evidence
    assert all(f.verdict == CEILING for (_, view), f in found.items() if view == "dense cache")
    # smd - naive = 0.25 on every seed: se 0 floored at (1/16) / sqrt(3) = 0.0361, t = 6.93 > 4.30
    beats = found[("SMD beats naive compression", "under eviction")]
    se = 1 / 16 / math.sqrt(3)
    assert beats.verdict == HOLDS and beats.decision.d.se == 0.0 and beats.decision.se == se
    assert f"se floored at {se:.3f} (the reward's resolution: one of 16 held-out prompts), t = {0.25 / se:.3g}" in beats.evidence
    # smd - sparse_rl = 1/16 on every seed: one prompt either way is no evidence (was "holds": se = 0, d > 0)
    one = found[("SMD beats Sparse-RL", "under eviction")]
    assert (one.verdict, one.decision.d.mean, one.decision.d.se) == (INCONCLUSIVE, 1 / 16, 0.0)
    assert 0.0625 / se < t_quantile(1 - 0.025, 2)  # t = 1.73 against 4.30
    report = write_report(tmp_path / "report", {"main": sweep}, {}, {"scale": "small"}).read_text()
    assert ("| SMD is near-lossless against dense at 50 % compression | GSM8K 73.6 vs 74.5 | main table | "
            "**uninformative (ceiling)** (") in report
    assert "4 uninformative (every run at the reward's bound)" in report  # the paper's four claims, dense cache
    assert "- main table, dense cache: at the ceiling: smd, naive_sparse, sparse_rl" in report
    rows = [r for r in csv.DictReader((tmp_path / "report" / "claims.csv").open()) if r["view"] == "dense cache"]
    assert rows and {r["verdict"] for r in rows} == {CEILING}


def test_without_the_number_of_prompts_se_zero_decides_nothing(tmp_path):
    """A run without a config saying how many prompts it evaluated: no floor, and a standard error of 0 is inconclusive."""
    sweep = small_sweep(tmp_path)
    for run in sweep.runs:
        (run.dir / "config.json").unlink()
    found = {(f.claim, f.view): f for f in claims.main_table(sweep, Sequential((3,)))}
    beats = found[("SMD beats naive compression", "under eviction")]
    assert beats.verdict == INCONCLUSIVE and "se 0 and the number of held-out prompts unknown: nothing measured" in beats.evidence
    assert found[("SMD is near-lossless against dense at 50 % compression", "dense cache")].verdict == CEILING  # bounds are known
    assert claims.measure(sweep, {"algo": "smd"}).resolution is None


def test_the_coarsest_run_sets_the_resolution(tmp_path):
    sweep = small_sweep(tmp_path, prompts=64)
    (sweep.select(algo="dense", seed="1")[0].dir / "config.json").write_text(json.dumps({"eval": {"num_prompts": 16}}))
    assert claims.measure(sweep, {"algo": "smd"}).resolution == 1 / 64
    assert claims.measure(sweep, {"algo": "smd"}, {"algo": "dense"}).resolution == 1 / 16


def failed_sweep(tmp_path, failures: dict[tuple[str, str], dict], prompts: str | None = "per_seed"):
    """`small_sweep` where the runs of `failures` ((algo, seed) -> their summary.json) failed as `smd ablate` records it
    ("failed (exit 1)", its error, the training's own summary beside it); `prompts`: eval.prompts in every config.json
    (None: a config from before the key)."""
    sweep = small_sweep(tmp_path)
    rows = json.loads((sweep.dir / "summary.json").read_text())
    for row in rows["runs"]:
        key = (row["algo"], row["seed"])
        if key in failures:
            row.update(status="failed (exit 1)", error=failures[key].get("status_reason"))
            (Path(row["dir"]) / "summary.json").write_text(json.dumps(failures[key]))
        config = json.loads((Path(row["dir"]) / "config.json").read_text())
        config["eval"].pop("prompts", None)
        if prompts is not None:
            config["eval"]["prompts"] = prompts
        (Path(row["dir"]) / "config.json").write_text(json.dumps(config))
    (sweep.dir / "summary.json").write_text(json.dumps(rows))
    return Sweep.read(sweep.name, sweep.dir)


def test_a_failed_seed_counts_as_the_worst_reward_in_every_comparison(tmp_path):
    """Sparse-RL diverged on seed 1: its seed is not dropped (survivorship: the comparison would keep only the seeds where
    Sparse-RL did not blow up), it counts as the reward's worst, 0, and the evidence names it; the table counts it."""
    diverged = {"status": "diverged", "status_reason": "loss is nan at step 7", "eval/evict/reward_after": 0.9}  # not a result
    sweep = failed_sweep(tmp_path, {("sparse_rl", "1"): diverged})
    found = {(f.claim, f.view): f for f in claims.main_table(sweep, Sequential((3,)))}
    beats = found[("SMD beats Sparse-RL", "under eviction")]
    # per seed, smd - sparse_rl: 0.75 - 0.6875, 0.8125 - 0 (failed), 0.6875 - 0.625
    assert beats.decision.d.n == 3 and beats.decision.d.mean == pytest.approx((0.0625 + 0.8125 + 0.0625) / 3)
    assert "failed runs, counted as 0 (the reward's worst): sparse_rl seed 1 (diverged: loss is nan at step 7)" in beats.evidence
    assert "sparse_rl 0.438 ± 0.219" in beats.evidence  # its cell with the failed seed at 0: (0.6875 + 0 + 0.625) / 3
    recovers = found[("Sparse-RL recovers the dense learner's result", "dense cache")]  # dense cache: 1.0 everywhere else
    assert recovers.decision.d.n == 3 and recovers.verdict != CEILING  # the failed run is not at the ceiling
    report = write_report(tmp_path / "report", {"main": sweep}, {}, {"scale": "small"}).read_text()
    assert "| sparse_rl | 2 | 0 | 1 |" in report  # n with results, collapsed, failed
    seeds = list(csv.DictReader((tmp_path / "report" / "seeds_main.csv").open()))
    assert [r["sparse_rl"] for r in seeds] == ["0.688", "failed", "0.625"]  # the per-seed table
    rows = {(r["algo"], r["seed"]): r for r in csv.DictReader((tmp_path / "report" / "runs.csv").open())}
    assert rows[("sparse_rl", "1")]["status"] == "failed (exit 1)"


def test_the_parity_claim_covers_every_smd_run_and_names_a_broken_one(tmp_path):
    """One of three SMD runs ended parity_broken (its guard found the learner off the sampler), the others held with
    check-parity's float64 replay clean: the claim over all SMD runs does not hold and names the broken run (before,
    only runs with status ok or collapsed were read, and the check alone gave "holds"); an SMD run that diverged
    leaves it inconclusive."""
    broken = {"status": "parity_broken", "status_reason": "learner 0.105 off the sampler at step 2 (float64: 0.105)"}
    sweep = failed_sweep(tmp_path, {("smd", "2"): broken})
    for run in sweep.select(algo="smd"):
        if run.ok:
            run.summary["train/mismatch/max_abs_diff_max"] = 3e-6
    check = {"bound": 1e-5, "policies": {"snapkv": {"views": {"shadow": {"max_abs_diff": 0.0}, "shadow_float64":
                                                              {"max_abs_diff": 1.2e-5, "rounding": 1.2e-5}}, "failed": []}}}
    [claim] = machinery.parity([sweep], check)
    assert claim.verdict == FAILS and claim.scope == "all 3 SMD runs, every eviction policy"
    name = sweep.select(algo="smd", seed="2")[0].dir.name
    assert f"parity broken in 1 of 3 SMD runs: {name} (parity_broken: learner 0.105 off the sampler at step 2" in claim.evidence
    diverged = failed_sweep(tmp_path / "other", {("smd", "2"): {"status": "diverged", "status_reason": "loss is nan"}})
    for run in diverged.select(algo="smd"):
        if run.ok:
            run.summary["train/mismatch/max_abs_diff_max"] = 3e-6
    [claim] = machinery.parity([diverged], check)
    assert claim.verdict == INCONCLUSIVE and "1 SMD runs failed before their parity was judged to the end" in claim.evidence


def test_verdicts_on_fixed_prompts_say_they_are_about_those_prompts(tmp_path):
    """Runs recorded before eval.prompts (their config names no draw) evaluated the same 16 prompts for every seed: each
    verdict says it is about those prompts, not the task (evidence, claims.csv, the tally); with each seed on its own
    prompts nothing is added."""
    fixed = failed_sweep(tmp_path, {}, prompts=None)
    beats = {(f.claim, f.view): f for f in claims.main_table(fixed, Sequential((3,)))}[("SMD beats naive compression", "under eviction")]
    assert beats.prompts == claims.FIXED and beats.verdict == HOLDS
    assert beats.evidence.startswith("about the 16 fixed held-out prompts that every seed evaluated, not the task: smd 0.750")
    report = write_report(tmp_path / "report", {"main": fixed}, {}, {"scale": "small"}).read_text()
    assert "All of them rest on runs that evaluated the same fixed held-out prompts for every seed" in report
    assert "16 test prompts, the same for every run and seed" in report
    rows = list(csv.DictReader((tmp_path / "report" / "claims.csv").open()))
    assert {r["prompts"] for r in rows if r["view"]} == {claims.FIXED}
    own = failed_sweep(tmp_path / "own", {})
    beats = {(f.claim, f.view): f for f in claims.main_table(own, Sequential((3,)))}[("SMD beats naive compression", "under eviction")]
    assert beats.prompts == claims.PER_SEED and beats.evidence.startswith("smd 0.750")
