"""`bench/gpu_check.sh`: the GPU run and its `--cpu` twin build the same model configs apart from depth (Qwen3-4B's,
read from conf/model/qwen3_4b_random.yaml, vocabulary included), and the CPU twin runs every check end to end at
one layer with real numbers: compiled flex_attention equal to the SDPA replay on GRPO rows and on distinct prompts,
the learner's measured peaks beside `smd plan`'s, SMD's learner memory within 5 % of naive_sparse's at the paper's
vocabulary."""

import importlib.util
import json
import subprocess

import pytest
import torch
import yaml

from smd_cli.cli import ROOT


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen3_4b() -> dict:
    return yaml.safe_load((ROOT / "conf" / "model" / "qwen3_4b_random.yaml").read_text())["config"]


def without_depth(widths: dict) -> dict:
    return {k: v for k, v in widths.items() if k != "num_hidden_layers"}


def test_cpu_and_gpu_modes_build_the_same_models_apart_from_depth(tiny_tokenizer):
    module = gpu_check()
    cpu, gpu = module.checks(cpu=True), module.checks(cpu=False)
    assert list(cpu) == list(gpu) == ["flex_parity_float32", "flex_parity_bfloat16", "learner_phases", "decode_speed", "adamw8bit", "offload"]
    for name in cpu:
        (cpu_fn, cpu_args), (gpu_fn, gpu_args) = cpu[name], gpu[name]
        assert cpu_fn is gpu_fn, name
        assert without_depth(cpu_args["widths"]) == without_depth(gpu_args["widths"]) == without_depth(qwen3_4b()), name
        assert cpu_args["widths"]["num_hidden_layers"] == 1 and gpu_args["widths"]["num_hidden_layers"] in (4, 36), name
        assert set(cpu_args) == set(gpu_args), name  # the same knobs, other values (rows, widths of the prompts, dtype)
        narrow_fn, narrow_args = module.checks(cpu=True, narrow=True)[name]  # the suite's run: only the widths differ
        assert narrow_fn is cpu_fn and narrow_args == {**cpu_args, "widths": {**cpu_args["widths"], **module.NARROW}}, name
    # the build the checks share, as load_model does it: the architecture's own vocabulary, not the tokenizer's (before,
    # `build_tiny_model(len(tokenizer), **widths)` raised "got multiple values for argument 'vocab_size'" at these widths)
    model = module.build(cpu["learner_phases"][1]["widths"], tiny_tokenizer, 0, torch.float32, torch.device("meta"))
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.num_hidden_layers) == (151936, 2560, 32, 8, 128, 9728, 1)
    assert model.get_input_embeddings().weight.shape == (151936, 2560) and config.tie_word_embeddings


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    """`bench/gpu_check.sh --cpu --narrow`: every check of the GPU run, end to end through the script, at narrow widths
    (at one layer of Qwen3-4B's widths, `--cpu` alone, it takes two minutes: run before a GPU session, not here)."""
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu", "--narrow", str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    one_layer = {**qwen3_4b(), "num_hidden_layers": 1, **gpu_check().NARROW}
    for name in ("flex_parity_float32", "flex_parity_bfloat16", "learner_phases", "decode_speed", "adamw8bit", "offload"):
        assert report[name]["ok"] and report[name]["model"] == one_layer, name
    flex = report["flex_parity_float32"]
    assert flex["flex_failure"] is None  # the compiled kernel ran, no fallback to SDPA
    for layout in ("grpo_rows", "distinct"):  # the response rows after a shared prompt, and the whole sequence
        assert flex[f"{layout}/flex_vs_sdpa_max_abs"] <= 1e-5 and flex[f"{layout}/flex_vs_sampler_max_abs"] <= 1e-5, layout
        assert flex[f"{layout}/flex_warnings"] == [], layout
    assert report["flex_parity_bfloat16"]["flex_failure"] is None
    phases = report["learner_phases"]
    for name in ("naive_sparse", "smd"):
        assert 0.85 <= phases[name]["learner_predicted_bytes"] / phases[name]["learner_peak_bytes"] <= 1.15, name
    assert phases["smd_over_naive_sparse_learner"] <= 1.05  # DESIGN.md contract 3 at the paper's vocabulary
    assert phases["naive_sparse"]["mismatch_max_abs_diff"] > 100 * phases["smd"]["mismatch_max_abs_diff"]  # SMD's parity
    speed = report["decode_speed"]
    assert speed["dense_tokens_per_second"] > 0 and speed["snapkv_tokens_per_second"] > 0
    assert speed["report"]["shape"]["vocab_size"] == gpu_check().NARROW["vocab_size"]
    assert "skipped" in report["adamw8bit"] and "skipped" in report["offload"]  # CUDA only
