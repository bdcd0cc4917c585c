"""The report's verdicts know the held-out reward they compare (DESIGN.md contract 6): a reward in [0, 1] averaged over
each run's `eval.num_prompts` held-out prompts. A comparison whose runs all sit at the ceiling says "uninformative
(ceiling)", never "holds" (the small reproduction's dense cache: 1.000 +- 0.000 in every arm, where "SMD is
near-lossless against dense" read "holds"), and a constant per-seed difference (se = 0) is judged against one prompt's
worth, not decided by its sign."""

import csv
import json
import math

from smd_cli.report import claims
from smd_cli.report.write import write_report
from smd_cli.stats import CEILING, HOLDS, INCONCLUSIVE, Sequential, t_quantile
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
