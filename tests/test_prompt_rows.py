"""A prompt's rows are attended in the compute dtype, even where `model.attention_dtype` widens the rest: the sampler's
prefill and every learner view compute them with one kernel on one shape, so the learner stays the sampler bit for
bit while a long prompt's attention, most of it, runs at float32 speed."""

import pytest
import torch
import torch.nn.functional as F

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_hidden
from smd_cli.learner.physical import physical_response_logits
from smd_cli.model.build import build_tiny_model, set_attention_dtype
from smd_cli.rollout.sampler import generate
from smd_cli.rollout.sampling import token_logprobs


def _model():
    model = build_tiny_model(300, seed=0, num_hidden_layers=3).eval()
    set_attention_dtype(model, "float64")
    return model


def _prompts(samples: int):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (40, 33, 27)]  # left padding for two
    return [p for p in prompts for _ in range(samples)]


def _learner_logp(model, b, evict_at):
    hidden = response_hidden(model, b.input_ids, b.attention_mask, b.prompt_length, evict_at)
    return token_logprobs(model.get_output_embeddings()(hidden), b.input_ids[:, b.prompt_length:]) * b.response_mask


@pytest.mark.parametrize("samples", [1, 3], ids=["distinct prompts", "3 samples a prompt"])
@pytest.mark.parametrize("policy", ["dense", "snapkv"])
def test_the_learner_is_the_sampler_bit_for_bit_with_a_float32_prefill(policy, samples):
    model = _model()
    make = {"dense": lambda: None, "snapkv": lambda: SnapKV(0.5, sink=2, window=4)}[policy]
    b = generate(model, _prompts(samples), policy=make(), max_new_tokens=8, generator=torch.Generator().manual_seed(1), eos_token_id=-1,
                 pad_token_id=0, measure_dense_kv=False)
    with torch.no_grad():
        assert torch.equal(_learner_logp(model, b, b.evict_at), b.logprobs * b.response_mask)
        if b.evict_at is not None:  # the physical-eviction learner re-runs the prefill as the sampler did
            physical = token_logprobs(physical_response_logits(model, b.input_ids, b.attention_mask, b.prompt_length, b.evict_at),
                                      b.input_ids[:, b.prompt_length:])
            assert torch.equal(physical * b.response_mask, b.logprobs * b.response_mask)


def test_only_the_prompt_rows_are_attended_in_the_compute_dtype(monkeypatch):
    """Of a rollout's and a learner's attention calls, the causal ones over a whole prompt run in float32, the decode
    steps and the learner's response rows in float64."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((query.shape[2], key.shape[2], query.dtype, kwargs.get("is_causal", False)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = _model()
    b = generate(model, _prompts(1), policy=SnapKV(0.5, sink=2, window=4), max_new_tokens=4, generator=torch.Generator().manual_seed(1),
                 eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)
    P = b.prompt_length
    layers = model.config.num_hidden_layers
    assert calls[:layers] == [(P, P, torch.float32, True)] * layers  # the prefill
    assert {c[2:] for c in calls[layers:]} == {(torch.float64, False)}  # 3 decode steps, query heads folded
    calls.clear()
    with torch.no_grad():
        _learner_logp(model, b, b.evict_at)
    assert [c for c in calls if c[3]] == [(P, P, torch.float32, True)] * layers  # the replay's prompt rows
    assert {c[2] for c in calls if not c[3]} == {torch.float64}  # its response rows
