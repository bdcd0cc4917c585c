"""The engine serves the decoder families users bring: Llama (SmolLM2), Qwen2 (Qwen2.5) and Qwen3 (the paper's).

For each family the test saves a tiny random checkpoint (2 layers, GQA 4/2, the project's tokenizer) and runs it
through the user's entry points with `model=hub model.name_or_path=DIR`: `load_model`, `smd rollout` (evicting,
shadow and physical parity against the sampler, float32 bound of DESIGN.md section 3), `smd train algo=smd` for
2 steps (prompt sharing, the shadow replay and the dense teacher, a checkpoint), and `smd eval` of that checkpoint.
A family the engine cannot replay (sliding-window or alternating attention) is refused with a config error naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from smd_cli.config.factories import build_task
from smd_cli.config.validation import ConfigError
from smd_cli.runs.model_loading import load_model
from smd_cli.stages import evaluate, rollout, train
from tests.conftest import ROOT

CONF = ROOT / "conf"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=True)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # q/k RMS norms
}


def save_tiny(path, tokenizer, config_cls, model_cls, **fields):
    torch.manual_seed(0)
    config = config_cls(vocab_size=len(tokenizer) + 15, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **{**SHAPE, **fields})
    model_cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compose_stage(stage, tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=stage, overrides=["model=hub", "device=cpu", "progress=false", f"cache_dir={tmp_path / 'cache'}",
                                                     *overrides])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_model_reads_each_family(family, tmp_path, tiny_tokenizer):
    config_cls, model_cls, fields = FAMILIES[family]
    path = save_tiny(tmp_path / family, tiny_tokenizer, config_cls, model_cls, **fields)
    cfg = compose_stage("rollout", tmp_path, f"model.name_or_path={path}", "task=needle", f"+run_dir={tmp_path / 'run'}")
    model, tokenizer = load_model(cfg, build_task(cfg), torch.device("cpu"))
    assert type(model).__name__ == model_cls.__name__ and model.config.model_type == family
    assert model.config._attn_implementation == "smd"
    assert model.config.smd_weights["source"] == "local" and len(tokenizer) >= len(tiny_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rollout_train_and_eval_through_the_cli(family, tmp_path, tiny_tokenizer):
    config_cls, model_cls, fields = FAMILIES[family]
    path = save_tiny(tmp_path / family, tiny_tokenizer, config_cls, model_cls, **fields)
    common = [f"model.name_or_path={path}", "task=needle", "task.prompt_tokens=40", "task.max_new_tokens=4", "compression=0.5"]

    summary = rollout.run(compose_stage("rollout", tmp_path, *common, "num_prompts=2", "num_generations=3", "eviction=h2o",
                                        f"+run_dir={tmp_path / 'rollout'}"))
    assert summary["parity/max_abs_diff_shadow"] <= 1e-5 and summary["parity/max_abs_diff_physical"] <= 1e-5
    assert summary["kv/kept_fraction"] < 0.8
    assert "evidence/kept_l1" in summary and summary["model/weights"].startswith(str(path))

    run_dir = tmp_path / "train"
    summary = train.run(compose_stage("train", tmp_path, *common, "algo=smd", "steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=2",
                                      "eval.num_prompts=2", "eval.batch_size=2", "eval.greedy=false", f"+run_dir={run_dir}"))
    assert summary["status"] == "completed"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and max(s["mismatch/max_abs_diff"] for s in steps) <= 1e-5  # SMD: learner = sampler
    saved = json.loads((run_dir / "final" / "config.json").read_text())
    assert saved["model_type"] == family and saved["smd_weights"]["source"] == "local"

    summary = evaluate.run(compose_stage("eval", tmp_path, *common, f"checkpoint={run_dir / 'final'}", "eval.limit=2",
                                         "eviction=snapkv", f"+run_dir={tmp_path / 'eval'}"))
    assert summary["n"] == 2 and 0.0 <= summary["metric"] <= 1.0
    assert "trained from" in summary["model/weights"]


@pytest.mark.parametrize("config_cls,model_cls,fields,named", [
    (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "Qwen2ForCausalLM"),
    (MistralConfig, MistralForCausalLM, {"sliding_window": 16, "head_dim": 16}, "MistralForCausalLM"),
])
def test_sliding_window_attention_is_refused_by_name(config_cls, model_cls, fields, named, tmp_path, tiny_tokenizer):
    path = save_tiny(tmp_path / "model", tiny_tokenizer, config_cls, model_cls, **fields)
    cfg = compose_stage("rollout", tmp_path, f"model.name_or_path={path}", "task=needle", f"+run_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=rf"{named}.*sliding-window or alternating attention"):
        load_model(cfg, build_task(cfg), torch.device("cpu"))
