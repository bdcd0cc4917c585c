"""`smd ablate`: the command line's sweep syntax, failed runs (reported with their reason, no bar, exit 1),
config mistakes caught before the first run, and real sweeps of tiny runs."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.cli import sweep_arguments
from smd_cli.stages import ablate as stage
from smd_cli.stages.ablate import AblationFailed, error_message, failure_reason, parse_sweep
from smd_cli.stages.common import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"

# Stands in for `smd train` (milliseconds instead of a model): lambda picks how the run ends.
FAKE_TRAIN = r"""
import json, pathlib, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = pathlib.Path(args["hydra.run.dir"])
run.mkdir(parents=True, exist_ok=True)
lam = args["lambda"]
print(f"fake train lambda={lam}")
(run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in range(3)))
if lam == "0.5":  # a crash: a traceback, then Hydra's hint
    sys.stderr.write('Traceback (most recent call last):\n  File "train.py", line 1, in <module>\n'
                     'ValueError: boom at step 3\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n')
    sys.exit(1)
if lam == "0.7":  # the CLI's config error, wrapped by rich at 80 columns
    sys.stderr.write("some warning\n\nconfig error: grpo.num_generations=1 is not allowed: an integer >= 2 (GRPO\n"
                     "normalises each reward against the other samples of its group)\n")
    sys.exit(2)
if lam == "0.9":  # the run wrote its own error into summary.json
    (run / "summary.json").write_text(json.dumps({"error": "loss is nan at step 2", "eval/reward_before": 0.25}))
    sys.stderr.write("training diverged: loss is nan at step 2\n")
    sys.exit(1)
(run / "summary.json").write_text(json.dumps({"eval/reward_before": 0.25, "eval/reward_after": 0.0}))
"""


def ablate_config(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("ablate", overrides=["progress=false", f"+run_dir={tmp_path / 'ablate'}", *overrides])


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


def test_failed_runs_are_reported_not_plotted_and_exit_1(tmp_path, monkeypatch, capfd):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(stage, "member_command", lambda base, combo, run_dir: [
        sys.executable, str(script), *base, *(f"{k}={v}" for k, v in combo), f"hydra.run.dir={run_dir}"])
    cfg = ablate_config(tmp_path, "ablate.sweep=['lambda=0.1,0.5,0.7,0.9']", "ablate.metrics=[eval/reward_before,eval/reward_after]")
    with pytest.raises(AblationFailed) as failed:
        stage.run(cfg)
    assert failed.value.code == 1
    message = str(failed.value)
    assert message.startswith("3 of 4 runs failed (lambda=0.5: ValueError: boom at step 3; lambda=0.7: config error: ")
    assert "lambda=0.9: loss is nan at step 2)" in message and "each failed run's stderr in its stderr.log" in message
    out, err = capfd.readouterr()
    assert "fake train lambda=0.5" in out  # the runs' stdout and stderr reach the terminal as they come
    assert "ValueError: boom at step 3" in err and "ablate failed: 3 of 4 runs failed" in err
    root = tmp_path / "ablate"
    rows = list(csv.DictReader((root / "ablation.csv").open()))
    assert [(r["lambda"], r["status"]) for r in rows] == [
        ("0.1", "ok"), ("0.5", "failed (exit 1)"), ("0.7", "failed (exit 2)"), ("0.9", "failed (exit 1)")]
    assert [r["error"] for r in rows] == [
        "", "ValueError: boom at step 3",
        ("config error: grpo.num_generations=1 is not allowed: an integer >= 2 (GRPO normalises each reward against "
         "the other samples of its group)"),
        "loss is nan at step 2"]
    assert [r["eval/reward_after"] for r in rows] == ["0.0", "", "", ""]  # a failure is missing, not 0
    md = (root / "ablation.md").read_text()
    assert "| lambda | eval/reward_before | eval/reward_after | status | error |" in md
    assert "| 0.5 | - | - | failed (exit 1) | ValueError: boom at step 3 |" in md
    summary = json.loads((root / "summary.json").read_text())
    assert summary["failed"] == ["lambda=0.5", "lambda=0.7", "lambda=0.9"]
    assert "ValueError: boom at step 3" in (root / "runs" / "lambda-0.5" / "stderr.log").read_text()
    assert (root / "ablation.png").stat().st_size > 10_000
    # the plot: a bar for the finished run (its real 0.0 included), none for the failed ones
    assert stage.plot(tmp_path, summary["runs"], "eval/reward_after") == {"lambda=0.1": 0.0}


def test_config_mistakes_stop_the_sweep_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "member_command", lambda *a: pytest.fail("no run may start"))
    with pytest.raises(ConfigError, match=r"ablate run lamda=0.1: Could not override 'lamda'.*Key 'lamda' is not in struct"):
        stage.run(ablate_config(tmp_path, "ablate.sweep=['lamda=0.1,0.8']"))
    with pytest.raises(ConfigError, match=r"ablate run eviction=nope: .*Could not find 'eviction/nope'"):
        stage.run(ablate_config(tmp_path, "ablate.sweep=['eviction=snapkv,nope']"))
    with pytest.raises(ConfigError, match=r"ablate.metrics=\[\] is not allowed: a non-empty list"):
        stage.run(ablate_config(tmp_path, "ablate.sweep=['lambda=0.1,0.8']", "ablate.metrics=[]"))
    assert not (tmp_path / "ablate").exists()


def test_error_message_and_failure_reason():
    wrapped = "\x1b[31mconfig error:\x1b[0m task=gsm8k split 'test': a.jsonl, line 2: field\n'answer' is null, expected a string\n"
    assert error_message(wrapped) == "config error: task=gsm8k split 'test': a.jsonl, line 2: field 'answer' is null, expected a string"
    assert error_message("progress 10%\rprogress 100%\n\nRuntimeError: CUDA out of memory\n\n") == "RuntimeError: CUDA out of memory"
    assert error_message("Could not override 'x'.\nKey 'x' is not in struct\n") == "Could not override 'x'. Key 'x' is not in struct"
    assert error_message("") == "" and len(error_message("ValueError: " + "x" * 1000)) == 300
    assert failure_reason(1, "ValueError: boom\n", {"error": "loss is nan"}) == "loss is nan"
    assert failure_reason(-9, "", {}) == "killed by SIGKILL (out of memory?)"
    assert failure_reason(3, "", {}) == "exit status 3, nothing on stderr"


@pytest.mark.slow
def test_ablate_cli_failed_runs_exit_1_with_the_reason(tmp_path):
    """Two real `smd train` runs that stop on a config error: each reason in the table, exit status 1."""
    out = tmp_path / "ablate"
    env = {**os.environ, "SMD_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "smd_cli.cli", "ablate", "grpo.num_generations=0,1", "progress=false", f"hydra.run.dir={out}"]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ablate failed: 2 of 2 runs failed" in done.stderr
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert [r["status"] for r in rows] == ["failed (exit 2)"] * 2
    for r in rows:
        assert r["error"].startswith(f"config error: grpo.num_generations={r['grpo.num_generations']} is not allowed: an integer >= 2")
    assert (out / "ablation.png").is_file() and json.loads((out / "summary.json").read_text())["failed"]


SEEDED_TRAIN = r"""
import json, pathlib, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = pathlib.Path(args["hydra.run.dir"])
run.mkdir(parents=True, exist_ok=True)
(run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
if args["lambda"] == "0.3" and args["seed"] == "2":
    sys.exit("boom")
(run / "summary.json").write_text(json.dumps({"eval/reward_after": float(args["lambda"]) + 0.1 * int(args["seed"])}))
"""


def test_seeds_are_averaged_with_their_standard_error(tmp_path, monkeypatch):
    script = tmp_path / "seeded_train.py"
    script.write_text(SEEDED_TRAIN)
    monkeypatch.setattr(stage, "member_command", lambda base, combo, run_dir: [
        sys.executable, str(script), *base, *(f"{k}={v}" for k, v in combo), f"hydra.run.dir={run_dir}"])
    cfg = ablate_config(tmp_path, "ablate.sweep=['lambda=0.1,0.3','seed=0,1,2']", "ablate.metrics=[eval/reward_after]")
    with pytest.raises(AblationFailed, match="1 of 6 runs failed"):
        stage.run(cfg)
    root = tmp_path / "ablate"
    groups = {r["lambda"]: r for r in csv.DictReader((root / "ablation_mean.csv").open())}
    # lambda 0.1: 0.1, 0.2, 0.3 -> mean 0.2, sample std 0.1, se 0.1 / sqrt(3); lambda 0.3: 0.3, 0.4 (seed 2 failed)
    assert float(groups["0.1"]["eval/reward_after"]) == pytest.approx(0.2)
    assert float(groups["0.1"]["eval/reward_after se"]) == pytest.approx(0.1 / 3 ** 0.5)
    assert float(groups["0.3"]["eval/reward_after"]) == pytest.approx(0.35)
    assert float(groups["0.3"]["eval/reward_after se"]) == pytest.approx(0.05)
    assert (groups["0.1"]["n"], groups["0.3"]["n"], groups["0.3"]["runs"]) == ("3", "2", "3")
    assert "| 0.3 | 0.35 ± 0.05 | 2/3 |" in (root / "ablation_mean.md").read_text()
    assert (root / "ablation_mean.png").stat().st_size > 10_000
    assert json.loads((root / "summary.json").read_text())["aggregated"]["over"] == ["seed"]
