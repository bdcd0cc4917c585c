"""`smd rollout` as a function: composed with Hydra's compose API, run on a small tiny-scale setting."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from smd_cli.config.validation import ConfigError
from smd_cli.stages import rollout as stage

CONF = Path(__file__).resolve().parents[1] / "conf"
KEYS = ["parity/max_abs_diff_shadow", "parity/max_abs_diff_physical", "mismatch/dense_mean_abs_diff", "mismatch/dense_kl_k3",
        "kv/bytes_peak", "kv/bytes_peak_dense", "kv/kept_fraction", "reward/mean"]


def config(tmp_path, *overrides):
    small = ["model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=2", "num_generations=2", "progress=false",
             "device=cpu", f"+run_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("rollout", overrides=[*small, *overrides])


@pytest.mark.parametrize("eviction", ["snapkv", "h2o"])
def test_rollout_stage_writes_rollouts_masks_and_summary(tmp_path, eviction):
    summary = stage.run(config(tmp_path, f"eviction={eviction}", "compression=0.5", "sampling.max_new_tokens=6"))
    assert set(KEYS) <= set(summary)
    assert summary["parity/max_abs_diff_shadow"] <= 1e-5 and summary["parity/max_abs_diff_physical"] <= 1e-5
    assert summary["mismatch/dense_mean_abs_diff"] > 1e-4  # an untrained model feels the eviction
    assert abs(summary["kv/bytes_peak"] / summary["kv/bytes_peak_dense"] - summary["kv/kept_fraction"]) <= 0.1
    assert json.loads((tmp_path / "summary.json").read_text()) == pytest.approx(summary)
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["response_ids"]) == len(r["logprobs"]) for r in rows)
    tensors = load_file(tmp_path / "shadow_masks.safetensors")
    assert tensors["evict_at"].shape == (4, 2, 2, tensors["input_ids"].shape[1])


def test_rollout_stage_names_a_bad_value(tmp_path):
    with pytest.raises(ConfigError, match="num_generations"):
        stage.run(config(tmp_path, "num_generations=0"))
    with pytest.raises(ConfigError, match="compression"):
        stage.run(config(tmp_path, "compression=1.5"))
