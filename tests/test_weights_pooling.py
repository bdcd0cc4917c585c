"""Runs that ran different weights are never pooled where results are compared. `model.source=auto` loads the Hub's
bf16 checkpoint online and the Q4_1-dequantised GGUF offline, so the seeds of one table can differ by the network
(a sweep resumed offline, seeds added the next day). Each run's summary.json says which weights ran
(`model/weights`): `smd ablate` then names each run's weights and averages only runs of the same weights, and the
reproduction report refuses to pool or pair them (before, both averaged the two models as one)."""

import csv
import json
import sys

import pytest

from smd_cli.report.data import Sweep, WeightsDiffer
from smd_cli.report.write import write_report
from smd_cli.runs import sweep
from tests.conftest import smd

HUB = "HuggingFaceTB/SmolLM2-135M-Instruct (hub: checkpoint dtype)"
GGUF = "HuggingFaceTB/SmolLM2-135M-Instruct (gguf: Q4_1-dequantised to float32 (GGUF SmolLM2-135M-Instruct.Q4_1.gguf))"

# Stands in for `smd train`: seeds 0 and 1 ran online (the Hub's weights), seed 2 offline (the GGUF's); reward 0.1 * (seed + 1).
FAKE_TRAIN = f"""
import json, pathlib, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = pathlib.Path(args["hydra.run.dir"])
run.mkdir(parents=True, exist_ok=True)
seed = int(args["seed"])
(run / "metrics.jsonl").write_text(json.dumps({{"step": 1, "reward": 0.5}}) + "\\n")
(run / "summary.json").write_text(json.dumps({{"status": "completed", "eval/reward_after": 0.1 * (seed + 1),
                                              "model/weights": {HUB!r} if seed < 2 else {GGUF!r}}}))
"""


def test_ablate_averages_only_runs_of_the_same_weights_and_names_them(tmp_path, monkeypatch, capsys):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "member_command", lambda overrides, run_dir: [sys.executable, str(script), *overrides, f"hydra.run.dir={run_dir}"])
    assert smd("ablate", "progress=false", "seed=0,1,2", "ablate.metrics=[eval/reward_after]", f"ablate.runs_dir={tmp_path / 'runs'}",
               f"hydra.run.dir={tmp_path / 'ablate'}") == 0
    assert "the runs ran 2 different weights" in " ".join(capsys.readouterr().out.split())
    rows = list(csv.DictReader((tmp_path / "ablate" / "ablation.csv").open()))
    assert [(r["seed"], r["weights"]) for r in rows] == [("0", HUB), ("1", HUB), ("2", GGUF)]
    means = {r["weights"]: r for r in csv.DictReader((tmp_path / "ablate" / "ablation_mean.csv").open())}
    assert set(means) == {HUB, GGUF}  # before: one row, n = 3, mean 0.2
    assert (float(means[HUB]["eval/reward_after"]), means[HUB]["n"]) == (pytest.approx((0.1 + 0.2) / 2), "2")
    assert (float(means[GGUF]["eval/reward_after"]), means[GGUF]["n"]) == (pytest.approx(0.3), "1")
    assert GGUF in (tmp_path / "ablate" / "ablation_mean.md").read_text()


def fake_sweep(root, name, keys, runs):
    """A sweep directory as `smd ablate` writes it: runs = [(swept values, the run's summary)]."""
    rows = []
    for i, (values, summary) in enumerate(runs):
        run_dir = root / name / f"run{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"status": "completed", **summary}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
        rows.append({**values, "status": "ok", "dir": str(run_dir)})
    (root / name / "summary.json").write_text(json.dumps({"runs": rows, "sweep": {k: [] for k in keys}}))
    return Sweep.read(name, root / name)


def runs(weights_of_seed, **values):
    return [({**values, "algo": algo, "seed": str(seed)}, {"eval/evict/reward_after": 0.5 + 0.1 * seed, "eval/reward_after": 0.9,
                                                          "model/weights": weights_of_seed(seed)})
            for algo in ("naive_sparse", "smd") for seed in range(3)]


def test_the_report_refuses_to_pool_runs_of_different_weights(tmp_path):
    main = fake_sweep(tmp_path, "main", ["algo", "seed"], runs(lambda seed: HUB if seed < 2 else GGUF))
    with pytest.raises(WeightsDiffer) as caught:
        write_report(tmp_path / "report", {"main": main}, {}, {"scale": "small"})
    message = str(caught.value)
    assert f"{HUB!r} in 4 runs (main: algo=naive_sparse,seed=0, main: algo=naive_sparse,seed=1, main: algo=smd,seed=0, ...)" in message
    assert f"{GGUF!r} in 2 runs (main: algo=naive_sparse,seed=2, main: algo=smd,seed=2)" in message
    assert "model.source=hub or model.source=gguf" in message and not (tmp_path / "report").exists()


def test_the_report_pools_runs_of_one_weights_and_tells_models_apart_by_a_swept_model_key(tmp_path):
    same = fake_sweep(tmp_path, "same", ["algo", "seed"], runs(lambda seed: GGUF))
    assert write_report(tmp_path / "report", {"main": same}, {}, {"scale": "small"}).is_file()
    by_model = fake_sweep(tmp_path, "models", ["model", "algo", "seed"],
                          runs(lambda seed: HUB, model="smollm2_hub") + runs(lambda seed: GGUF, model="smollm2_gguf"))
    write_report(tmp_path / "report2", {"main": by_model}, {}, {"scale": "small"})  # two models, each its own weights: fine
    mixed = fake_sweep(tmp_path, "mixed", ["model", "algo", "seed"], runs(lambda seed: HUB if seed else GGUF, model="smollm2"))
    with pytest.raises(WeightsDiffer, match="the runs of model=smollm2 ran different weights"):
        write_report(tmp_path / "report3", {"main": mixed}, {}, {"scale": "small"})
