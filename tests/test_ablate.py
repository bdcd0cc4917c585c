"""`smd ablate`: the command line's sweep syntax, and one real sweep of two tiny runs."""

import csv
import json
import os
import subprocess
import sys

import pytest

from smd_cli.cli import sweep_arguments
from smd_cli.stages.ablate import parse_sweep
from smd_cli.stages.common import ConfigError


def test_sweep_arguments_split_swept_from_fixed():
    out = sweep_arguments(["lambda=0.1,0.8", "algo=smd", "hydra.run.dir=/x", "grpo.epsilon=0.1,0.2", "+recipe=tiny_smd"])
    assert out == ["algo=smd", "hydra.run.dir=/x", "+recipe=tiny_smd", "ablate.sweep=['lambda=0.1,0.8','grpo.epsilon=0.1,0.2']"]
    assert sweep_arguments(["steps=3"]) == ["steps=3"]


def test_parse_sweep_and_its_errors():
    assert parse_sweep(["lambda=0.1,0.8", "eviction=snapkv,recent"]) == [("lambda", ["0.1", "0.8"]), ("eviction", ["snapkv", "recent"])]
    with pytest.raises(ConfigError, match="give at least one KEY=v1,v2"):
        parse_sweep([])
    with pytest.raises(ConfigError, match="write KEY=v1,v2"):
        parse_sweep(["lambda"])


@pytest.mark.slow
def test_ablate_runs_each_value_and_writes_table_and_plot(tmp_path):
    out = tmp_path / "ablate"
    env = {**os.environ, "SMD_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "smd_cli.cli", "ablate", "lambda=0.0,0.5", "algo=smd", "steps=2", "grpo.prompts_per_step=2",
               "grpo.num_generations=2", "eval.num_prompts=4", "task.prompt_tokens=40", "model.warmstart.steps=2",
               "progress=false", f"hydra.run.dir={out}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert [r["lambda"] for r in rows] == ["0.0", "0.5"] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert float(r["last/mismatch/max_abs_diff"]) <= 1e-5  # SMD: the learner sees what the sampler saw
        config = json.loads((out / "runs" / f"lambda-{r['lambda']}" / "config.json").read_text())
        assert config["lambda"] == float(r["lambda"]) and config["steps"] == 2
    assert (out / "ablation.png").stat().st_size > 10_000
    assert "| lambda |" in (out / "ablation.md").read_text()
