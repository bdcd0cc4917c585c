"""A run's status never contradicts the parity it measured (DESIGN.md contracts 1 and 6), through `smd train`.

Defence (a): a family whose layer-by-layer learner is not its sampler's policy (Granite's embedding and logit
multipliers, Cohere's logit scale) is refused by name before anything is loaded (`smd_cli.model.build.REPLAYED`; the
list itself is held by tests/test_architecture_allowlist.py). Defence (b): should such a family get through (here:
Granite put on the allow-list by the test), `smd train` judges SMD's logged parity every step and stops with status
`parity_broken`, never `completed`. And `sampling.top_k=1` (every sample of a group the same, no gradient) is
refused before anything runs."""

from __future__ import annotations

import json

import pytest
from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

from smd_cli.model import build as models
from tests.conftest import smd
from tests.test_architectures import save_tiny

GRANITE = dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0625)  # granite-3's
TRAIN = ["model=hub", "device=cpu", "progress=false", "task=needle", "task.prompt_tokens=40", "task.max_new_tokens=4", "algo=smd",
         "steps=3", "grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=2", "eval.batch_size=2", "eval.greedy=false",
         "checkpoint.every=0"]


def said(capsys) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


@pytest.mark.parametrize("config_cls,model_cls,fields,arch,why", [
    (GraniteConfig, GraniteForCausalLM, GRANITE, "GraniteForCausalLM", "it scales its embeddings and logits (embedding_multiplier, logits_scaling)"),
    (CohereConfig, CohereForCausalLM, {}, "CohereForCausalLM", "it scales its logits (logit_scale)"),
])
def test_a_family_whose_learner_is_not_its_sampler_is_refused_by_name(config_cls, model_cls, fields, arch, why, tmp_path, tiny_tokenizer, capsys):
    path = save_tiny(tmp_path / "model", tiny_tokenizer, config_cls, model_cls, **fields)
    code = smd("train", *TRAIN, f"model.name_or_path={path}", f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}")
    out = said(capsys)
    assert code == 2, out
    assert f"config error: model=hub ({arch}, model_type '{config_cls.model_type}') is not supported: {why}" in out
    assert "the layer-by-layer learner would not be the sampler's policy" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before a step (was: 12 steps and status completed)


def test_a_learner_that_is_not_the_sampler_stops_the_run_as_parity_broken(tmp_path, tiny_tokenizer, capsys, monkeypatch):
    monkeypatch.setattr(models, "REPLAYED", models.REPLAYED | {"granite"})  # defence (a) let through: (b) must catch it
    path = save_tiny(tmp_path / "granite", tiny_tokenizer, GraniteConfig, GraniteForCausalLM, **GRANITE)
    run = tmp_path / "run"
    code = smd("train", *TRAIN, f"model.name_or_path={path}", f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}")
    out = said(capsys)
    assert code == 1, out
    summary = json.loads((run / "summary.json").read_text())
    miss = summary["parity/broken_miss"]
    assert miss > 1e-2  # the learner leaves Granite's multipliers out (measured 0.27 for a random tiny model)
    assert summary["status"] == "parity_broken" and summary["parity_broken_at_step"] == 1
    # judged on step 1's own rollout before its update: stopped there, no step taken or logged
    assert summary["steps_run"] == 0 and not (run / "metrics.jsonl").exists()
    assert summary["status_reason"].startswith(f"the learner is not the sampler's policy: at step 1 the learner's parity max "
                                               f"|log p_learner - log p_sampler| was {miss:.3g}, above the bound 1e-05, and the "
                                               "float64 replay of that step's rollout at the same weights misses the sampler by")
    assert "a mask error, not rounding; the step's update was not made" in summary["status_reason"]
    assert "parity check failed: the learner is not the sampler's policy" in out and "status parity_broken" in out
    assert not (run / "final").exists()  # a broken learner's weights are not published


def test_a_family_on_the_list_completes_with_its_parity_judged(tmp_path, tiny_tokenizer, capsys):
    path = save_tiny(tmp_path / "llama", tiny_tokenizer, LlamaConfig, LlamaForCausalLM)
    run = tmp_path / "run"
    code = smd("train", *TRAIN, "steps=2", f"model.name_or_path={path}", f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}")
    assert code == 0, said(capsys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["parity/judged"] == 1.0 and summary["parity/bound"] == 1e-5
    assert summary["parity/rounding_misses"] == 0
    assert summary["train/mismatch/max_abs_diff_max"] <= 1e-5


def test_a_bf16_run_is_judged_against_its_contract_bound_and_its_replay_is_the_sampler(tmp_path, tiny_tokenizer, capsys):
    """bf16 compute on the CPU (`model.cpu_dtype=bfloat16`): the guard judges it (bound 1e-5, `checks/contracts.py`), and
    the learner's replay is the sampler's log-probs within that bound at every step, where the dense learner of the same
    evicting rollouts is not (results/bf16_cpu.md measures SmolLM2)."""
    path = save_tiny(tmp_path / "llama", tiny_tokenizer, LlamaConfig, LlamaForCausalLM)
    run = tmp_path / "run"
    code = smd("train", *TRAIN, "model.cpu_dtype=bfloat16", "model.attention_dtype=float64", f"model.name_or_path={path}", f"cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={run}")
    assert code == 0, said(capsys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["parity/judged"] == 1.0 and summary["parity/bound"] == 1e-5
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and all(s["mismatch/max_abs_diff"] <= 1e-5 for s in steps)
    assert max(s["mismatch/dense_max_abs_diff"] for s in steps) > 1e-2  # the eviction's mismatch, which the replay removes
    provenance = json.loads((run / "provenance.json").read_text())
    assert provenance["compute_dtype"] == summary["model/compute_dtype"] == "bfloat16"
    # with the attention summed in bf16 the kernels' rounding (2e-3 here) has no contract bound: reported, not judged
    code = smd("train", *TRAIN, "steps=1", "model.cpu_dtype=bfloat16", f"model.name_or_path={path}", f"cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={tmp_path / 'plain'}")
    assert code == 0
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert plain["status"] == "completed" and plain["parity/judged"] == 0.0
    assert "parity not judged: bfloat16 compute with the attention summed in bfloat16 has no contract bound" in said(capsys)


def test_top_k_1_is_refused_before_anything_runs(tmp_path, capsys):
    code = smd("train", "sampling.top_k=1", "progress=false", f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    out = said(capsys)
    assert out.startswith("config error: sampling.top_k=1 is not allowed: an integer >= 0")
    assert out.endswith("; and not 1 for GRPO: top_k=1 samples the most probable token every time, so every sample of a group "
                        "is the same, every advantage 0 and no step has a gradient")
    assert not (tmp_path / "cache").exists()
