"""`bench/gpu_check.sh --cpu`: the GPU checks' script runs end to end at tiny shapes, so it is known to work
before a GPU is lent, and its report holds real numbers."""

import json
import subprocess

import pytest

from smd_cli.cli import ROOT


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["flex_parity_float32"]["flex_vs_sdpa_max_abs"] <= 1e-5  # flex (eager on the CPU) = the SDPA replay
    assert report["flex_parity_float32"]["flex_vs_sampler_max_abs"] <= 1e-5
    phases = report["learner_phases"]
    for name in ("naive_sparse", "smd"):
        assert 0.85 <= phases[name]["learner_predicted_bytes"] / phases[name]["learner_peak_bytes"] <= 1.15
    assert report["decode_speed"]["dense_tokens_per_second"] > 0
    assert "skipped" in report["adamw8bit"]
