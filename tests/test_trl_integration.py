"""SMD inside TRL (`smd_cli.integrations.trl`), at the tiny scale: TRL's learner log-probabilities under the replay equal
the sampler's and an eager reference fed the decoded shadow masks, per eviction policy; every TRL setting and model family it
cannot honour is refused by name; one step through the trainer as examples/trl_smd.py uses it."""

import dataclasses
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is the optional extra [trl] (make install installs it)")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from transformers import AttentionInterface, PrinterCallback  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from smd_cli.attention.dispatch import use_smd_attention  # noqa: E402
from smd_cli.attention.shadow import decode_visibility, position_ids_from_mask  # noqa: E402
from smd_cli.integrations.trl import POLICIES, SMDConfig, SMDGRPOTrainer, refusals  # noqa: E402
from smd_cli.model.build import build_tiny_model  # noqa: E402
from smd_cli.rollout.sampling import token_logprobs  # noqa: E402

BOUND = 1e-5  # DESIGN.md contract 1, float32 on the CPU
REFERENCE = "trl_test_explicit_masks"
SMALL = dict(sink=2, window=4)  # the tiny prompts are ~20-30 tokens: a budget that evicts


def _explicit_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with an explicit per-layer, per-KV-head boolean mask [N, Hkv, T, T] (expanded to the query heads)."""
    allowed = kwargs["explicit_masks"][module.layer_idx].repeat_interleave(module.num_key_value_groups, dim=1)
    additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, float("-inf"))
    return eager_attention_forward(module, query, key, value, additive, scaling=scaling, dropout=dropout)


AttentionInterface.register(REFERENCE, _explicit_mask_attention)


def reward(completions, **_) -> list[float]:
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    prompts = [tiny_tokenizer.bos_token + " ".join(words[:n]) for n in (18, 13)]  # two lengths: left padding
    return Dataset.from_list([{"prompt": p} for p in prompts])


CHECKPOINTING = "activation_checkpointing" if "activation_checkpointing" in {f.name for f in dataclasses.fields(GRPOConfig)} \
    else "gradient_checkpointing"  # transformers 5.2x's name, and the older one


def config(tmp_path, **fields) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path / "trl"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=5, learning_rate=0.0, bf16=False, use_cpu=True, **{CHECKPOINTING: False},
                shuffle_dataset=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, top_k=0, seed=0)
    return GRPOConfig(**{**base, **fields})


def trainer_for(model, tokenizer, data, args, smd: SMDConfig) -> SMDGRPOTrainer:
    trainer = SMDGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer, smd=smd)
    trainer.remove_callback(PrinterCallback)
    return trainer


def eager_reference(model, batch) -> torch.Tensor:
    """Log-probs [N, R] of the rollout's tokens from an eager forward fed each layer's visibility, decoded from the shadow
    mask (`decode_visibility`), as explicit [T, T] masks: none of the replay's kernels."""
    width, P = batch.input_ids.shape[1], batch.prompt_length
    seen = decode_visibility(batch.evict_at) | torch.eye(width, dtype=torch.bool)  # [N, L, Hkv, T, T]; padding sees itself
    masks = [seen[:, layer] for layer in range(seen.shape[1])]
    model.config._attn_implementation = REFERENCE
    try:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, position_ids=position_ids_from_mask(batch.attention_mask),
                           explicit_masks=masks, logits_to_keep=width - P + 1).logits[:, :-1]
    finally:
        use_smd_attention(model)
    return token_logprobs(logits, batch.input_ids[:, P:])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_replayed_trl_logprobs_equal_the_sampler_and_an_eager_masked_reference(tmp_path, tiny_tokenizer, data, policy):
    model = build_tiny_model(len(tiny_tokenizer), seed=0)
    trainer = trainer_for(model, tiny_tokenizer, data, config(tmp_path), SMDConfig(policy=policy, compression=0.5, policy_kwargs={}
                          if policy == "none" else SMALL))
    trainer.train()  # one step at learning rate 0: the weights stay the rollout's
    got = trainer.rollout_parity()
    batch = trainer._rollouts["train"]
    real = batch.response_mask
    assert got["tokens"] == int(real.sum()) > 0
    assert got["replay_max_abs_diff"] <= BOUND, got
    assert float((eager_reference(model, batch) - batch.logprobs)[real].abs().max()) <= BOUND
    if policy != "none":  # what SMD removes: TRL's own (dense) learner scores another policy than the sampler's
        assert got["trl_max_abs_diff"] > 1e-3, got
    # the same parity inside TRL's loss, at its first step: TRL's importance ratio is 1 within the bound
    logged = next(h for h in trainer.state.log_history if "smd/mismatch/max_abs_diff" in h)
    assert logged["smd/mismatch/max_abs_diff"] <= BOUND and logged["clip_ratio/region_mean"] == 0.0


def test_replay_with_kv_quant_and_a_truncated_sampling_support(tmp_path, tiny_tokenizer, data):
    """The other members of the replay family (DESIGN.md contract 7) through TRL: an int8 cache and top-k / top-p."""
    model = build_tiny_model(len(tiny_tokenizer), seed=0)
    trainer = trainer_for(model, tiny_tokenizer, data, config(tmp_path, top_k=20, top_p=0.9),
                          SMDConfig(policy="h2o", compression=0.5, kv_quant="int8", policy_kwargs=SMALL))
    trainer.train()
    batch = trainer._rollouts["train"]
    assert batch.kv_quant == "int8" and batch.sampling_support is not None
    assert trainer.rollout_parity()["replay_max_abs_diff"] <= BOUND


REFUSED = {
    "use_vllm": dict(use_vllm=True),
    "continuous_batching": dict(use_transformers_continuous_batching=True),
    "loss_type": dict(loss_type="dr_grpo"),
    "bf16": dict(bf16=True),
    "min_p": dict(min_p=0.1),
    "repetition_penalty": dict(repetition_penalty=1.1),
    "pad_to_multiple_of": dict(pad_to_multiple_of=8),
    "max_completion_length": dict(max_completion_length=None),
    "entropy_coef": dict(entropy_coef=0.01),
    "use_liger_kernel": dict(use_liger_kernel=True),
    "reentrant_checkpointing": {CHECKPOINTING: True, f"{CHECKPOINTING}_kwargs": {"use_reentrant": True}},
}


@pytest.mark.parametrize("setting", sorted(REFUSED))
def test_refuses_a_trl_setting_it_cannot_honour(tmp_path, tiny_tokenizer, data, setting):
    args = config(tmp_path, **REFUSED[setting])
    key = "use_reentrant" if setting == "reentrant_checkpointing" else next(iter(REFUSED[setting]))
    with pytest.raises(ValueError, match=f"cannot honour .*{key}"):
        SMDGRPOTrainer(model=build_tiny_model(len(tiny_tokenizer), seed=0), reward_funcs=reward, args=args, train_dataset=data,
                       processing_class=tiny_tokenizer)


@pytest.mark.parametrize("name", ["rollout_func", "peft_config", "tools"])
def test_refuses_trainer_arguments_it_cannot_honour(tmp_path, name):
    assert any(p.startswith(f"{name}=") for p in refusals(config(tmp_path), {name: object()}))


def test_refuses_a_model_family_off_the_allow_list(tmp_path, tiny_tokenizer, data):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tiny_tokenizer), n_positions=128))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        trainer_for(gpt2, tiny_tokenizer, data, config(tmp_path), SMDConfig())


def test_config_refuses_what_the_engine_does_not_have():
    with pytest.raises(ValueError, match="SMDConfig.policy"):
        SMDConfig(policy="pyramidkv")
    with pytest.raises(ValueError, match="compression"):
        SMDConfig(compression=1.0)
    with pytest.raises(ValueError, match="lam"):
        SMDConfig(lam=-0.1)
    with pytest.raises(ValueError):
        SMDConfig(kv_quant="int4")
    with pytest.raises(ValueError, match="backend"):
        SMDConfig(replay_backend="cuda")


def test_policy_names_are_conf_eviction_targets():
    from pathlib import Path

    import yaml

    conf = Path(__file__).resolve().parents[1] / "conf" / "eviction"
    targets = {p.stem: yaml.safe_load(p.read_text())["_target_"] for p in conf.glob("*.yaml")}
    assert {name: f"{cls.__module__}.{cls.__name__}" for name, cls in POLICIES.items()} == targets


def test_one_step_through_the_trainer_as_the_example_uses_it(tmp_path, tiny_tokenizer, data):
    """SnapKV 0.5, lambda 0.1, TRL's default gradient checkpointing, two micro-batches of a shuffled generation batch: one
    real update whose passes are the sampler's policy, the teacher's KL in the loss, the learner in eval-mode semantics
    (no dropout module training)."""
    model = build_tiny_model(len(tiny_tokenizer), seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_for(model, tiny_tokenizer, data, config(tmp_path, learning_rate=1e-2, per_device_train_batch_size=4,
                                                              gradient_accumulation_steps=2, **{CHECKPOINTING: True}),
                          SMDConfig(policy="snapkv", compression=0.5, lam=0.1, policy_kwargs=SMALL))
    trainer.train()
    log = next(h for h in trainer.state.log_history if "smd/distill" in h)  # the micro-batches' mean
    assert log["smd/mismatch/max_abs_diff"] <= BOUND < log["smd/mismatch/dense_max_abs_diff"]
    assert log["smd/distill"] > 0 and torch.isfinite(torch.tensor(log["loss"]))
    assert 0.3 < log["smd/kv_kept_fraction"] < 0.8
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "no update"
    assert not any(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_a_reference_model_is_scored_in_the_replayed_view(tmp_path, tiny_tokenizer, data):
    """beta > 0: TRL loads the reference from the model's path; the integration scores it under the rollout's shadow mask
    (as `smd train` does), so at the rollout's weights its KL to the policy is 0."""
    build_tiny_model(len(tiny_tokenizer), seed=0).save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    trainer = trainer_for(str(tmp_path / "model"), tiny_tokenizer, data, config(tmp_path, beta=0.04),
                          SMDConfig(policy="snapkv", compression=0.5, policy_kwargs=SMALL))
    trainer.train()
    log = next(h for h in trainer.state.log_history if "kl" in h)
    assert abs(log["kl"]) <= 1e-6 and log["smd/mismatch/max_abs_diff"] <= BOUND
