"""The memory planner: its predictions against live tensor bytes measured by the profiler at four sizes
(every phase within 15 %), its static terms by hand, and `smd plan` on every paper recipe."""

import importlib.util
import json

import pytest

from smd_cli.checks.planner import Arch, Run, largest_fitting, plan
from smd_cli.cli import ROOT, main

QWEN3_4B = Arch(layers=36, hidden=2560, intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936)


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("index", range(4))
def test_predictions_within_15_percent_of_measured_live_bytes(index):
    check = load_bench("plan_check")
    result = check.measure(*check.SMALL[index])
    for phase, ratio in result["ratios"].items():
        assert 0.85 <= ratio <= 1.15, f"{result['size']} {phase}: predicted / measured = {ratio:.3f}"
    assert result["measured"]["rollout"] > 0 and result["measured"]["learner smd"] > 0


def test_static_memory_of_qwen3_4b_by_hand():
    assert QWEN3_4B.params == 4_022_468_096  # the published parameter count
    run = Run(arch=QWEN3_4B, compute_bytes=2, device="cuda", algo="smd", rows=16, micro_batch=4, rollout_rows=16,
              prompt=1024, response=256, kept=512, cache_growth=255)
    static = plan(run).static
    params = QWEN3_4B.params
    assert static["weights"] == 2 * params and static["master weights"] == 4 * params
    assert static["gradients"] == 4 * params and static["optimizer state"] == 8 * params  # AdamW: two float32 moments
    # the rollout's KV cache: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes per kept slot
    assert plan(run).rollout["kv cache"] == 16 * 36 * 8 * 128 * 2 * 2 * (512 + 255)


def test_largest_micro_batch_is_the_boundary():
    run = Run(arch=QWEN3_4B, compute_bytes=2, device="cuda", algo="smd", rows=256, micro_batch=8, rollout_rows=64,
              prompt=2048, response=512, kept=1024, cache_growth=511)
    capacity = 100 * 2**30
    best = largest_fitting(run, "micro_batch", 256, capacity)
    from dataclasses import replace

    assert plan(replace(run, micro_batch=best)).learner_bytes <= capacity < plan(replace(run, micro_batch=best + 1)).learner_bytes


@pytest.mark.parametrize("recipe", ["gsm8k", "tldr", "govreport", "hotpotqa"])
def test_smd_plan_runs_offline_for_every_paper_recipe(tmp_path, recipe):
    main(["plan", f"+recipe={recipe}", f"hydra.run.dir={tmp_path}"])
    out = json.loads((tmp_path / "plan.json").read_text())
    assert out["params"] == QWEN3_4B.params and out["run"]["algo"] == "smd"
    assert set(out["devices"]) == {"80", "141"}
    assert out["peaks"]["step"] == max(out["peaks"]["rollout"], out["peaks"]["learner"]) > out["peaks"]["static"]


def test_per_gpu_memory_with_fsdp2_by_hand(tmp_path, capsys):
    """`plan.gpus=8`: the float32 shards, gradients and AdamW moments split eight ways, all of Qwen3-4B's bf16
    weights gathered for the rollout, one eighth of the rows (and so of the KV cache) per GPU."""
    params = QWEN3_4B.params
    layer = 2560 * 32 * 128 * 2 + 2560 * 8 * 128 * 2 + 2 * 128 + 3 * 2560 * 9728 + 2 * 2560  # q, o; k, v; norms; MLP
    run = Run(arch=QWEN3_4B, compute_bytes=2, device="cuda", algo="smd", rows=16, micro_batch=4, rollout_rows=16,
              prompt=1024, response=256, kept=512, cache_growth=255, gpus=8)
    result = plan(run)
    assert result.static_bytes == (4 + 4 + 8) * params / 8
    assert result.rollout["gathered weights"] == 2 * params
    assert result.learner["gathered weights"] == 2 * (params - 36 * layer) + (2 * 2 + 4) * layer
    main(["plan", "+recipe=gsm8k", "plan.gpus=8", f"hydra.run.dir={tmp_path}"])
    out = json.loads((tmp_path / "plan.json").read_text())
    assert out["run"]["gpus"] == 8 and out["run"]["rows"] == 128 * 8 // 8  # GSM8K: 128 prompts x 8 samples a step
    assert out["static"]["optimizer state"] == 8 * params / 8
    with pytest.raises(SystemExit):
        main(["plan", "plan.gpus=3", f"hydra.run.dir={tmp_path / 'bad'}"])
    printed = " ".join(capsys.readouterr().err.split())
    assert "plan.gpus=3 is not allowed: a divisor of grpo.prompts_per_step=16 (each GPU" in printed, printed[-300:]
