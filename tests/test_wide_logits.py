"""`model.logits_dtype`: the LM head computes its logits in float64 (`models.WideLogits`), the same module and weight."""

from __future__ import annotations

import pytest
import torch

from smd_cli.learner.forward import response_hidden, vocab_terms
from smd_cli.model import build as models
from smd_cli.rollout.sampler import generate


def tiny(dtype_name=None):
    model = models.build_tiny_model(300, seed=0)
    models.set_logits_dtype(model, dtype_name)
    return model


def test_the_head_projects_in_float64_and_keeps_its_parameters():
    plain, wide = tiny(), tiny("float64")
    assert list(wide.state_dict()) == list(plain.state_dict())  # checkpoints are unchanged
    head = wide.get_output_embeddings()
    assert head.weight is wide.get_input_embeddings().weight  # still tied
    hidden = torch.randn(5, head.in_features) * 3
    with torch.no_grad():
        logits = head(hidden)
    # by hand, in float64: sum_d h_d w_vd
    expected = (hidden.double()[:, None, :] * head.weight.double()[None]).sum(-1)
    assert logits.dtype == torch.float64
    assert (logits - expected).abs().max() < 1e-12
    narrow = plain.get_output_embeddings()(hidden)
    assert narrow.dtype == torch.float32 and (narrow.double() - expected).abs().max() > 1e-8  # float32 rounds visibly


def test_the_float64_weight_follows_a_fused_update_and_the_gradient_reaches_the_weight():
    model = tiny("float64")
    head = model.get_output_embeddings()
    hidden = torch.randn(4, head.in_features)
    with torch.no_grad():
        before = head(hidden)
        with models.fixed_weights(model):  # a rollout's scope: the cast is made once
            assert head.fixed is not None and torch.equal(head(hidden), before)
        assert head.fixed is None
        version = head.weight._version
        head.weight.grad = torch.full_like(head.weight, -1.0)
        torch.optim.AdamW([head.weight], lr=0.5, weight_decay=0.0, fused=True).step()  # in place, version unchanged
        assert head.weight._version == version
        after = head(hidden)
    assert (after - hidden.double() @ head.weight.double().T).abs().max() < 1e-12  # the updated weight, not the cached one
    assert (after - before - 0.5 * hidden.double().sum(-1, keepdim=True)).abs().max() < 1e-4  # Adam's first step: lr * sign
    head.weight.grad = None
    head(hidden).sum().backward()  # d/dW sum_{n,v} h_n . w_v = sum_n h_n for every row v
    assert head.weight.grad.dtype == torch.float32
    assert (head.weight.grad - hidden.sum(0)).abs().max() < 1e-5


def test_the_learner_scores_the_sampler_s_float64_log_probs():
    """Sampler and learner both go through the wide head: the replayed log-probs are the recorded ones, and so
    are the float64 hand log-softmax of the learner's own hidden states."""
    model = tiny("float64").eval()
    prompts = [[5 + (7 * i + j) % 250 for j in range(12)] for i in range(4)]
    batch = generate(model, prompts, policy=None, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0),
                     eos_token_id=2, pad_token_id=0, measure_dense_kv=False)
    with torch.no_grad():
        hidden = response_hidden(model, batch.input_ids, batch.attention_mask, batch.prompt_length)
        tokens = batch.input_ids[:, batch.prompt_length:]
        logp = vocab_terms(model.get_output_embeddings(), hidden, tokens, batch.response_mask)["logp"]
        weight = model.get_output_embeddings().weight.double()
        by_hand = torch.log_softmax(hidden.double() @ weight.T, -1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = batch.response_mask
    assert logp.dtype == torch.float64
    assert (logp - by_hand)[mask].abs().max() < 1e-12
    assert (logp - batch.logprobs.double())[mask].abs().max() < 1e-6


def test_a_head_that_is_not_a_linear_layer_is_named():
    model = tiny()
    model.set_output_embeddings(torch.nn.Identity())
    with pytest.raises(TypeError, match="model.logits_dtype=float64: the LM head is a Identity"):
        models.set_logits_dtype(model, "float64")


def test_widened_attention_sums_in_float64_and_returns_the_input_dtype():
    """`kernels.widened`: causal and grouped attention against an eager float64 softmax(q k^T / sqrt(d)) v by hand."""
    from smd_cli.attention import kernels

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16) * 3 for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # 2 KV heads for 4 query heads
    scale = 16 ** -0.5
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = (q.double() @ kk.transpose(-1, -2)) * scale
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    by_hand = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ vv
    with kernels.widened(torch.float64):
        wide = kernels.causal(q, k, v, scale)
        grouped = kernels.grouped(q, k, v, causal[None, None].expand(2, 2, 9, 9), scale)
    narrow = kernels.causal(q, k, v, scale)
    assert wide.dtype == grouped.dtype == torch.float32 and kernels.widening(torch.float32) is None
    assert (wide.double() - by_hand).abs().max() < 1e-6 and (grouped.double() - by_hand).abs().max() < 1e-6  # float32 output rounding
    # the float64 sum, rounded once, is nearer the exact one than float32's own
    assert (wide.double() - by_hand).abs().max() <= (narrow.double() - by_hand).abs().max()


def test_a_checkpoint_s_saved_attention_dtype_does_not_carry_over(tmp_path):
    model = tiny()
    models.set_attention_dtype(model, "float64")
    model.save_pretrained(tmp_path)
    assert '"smd_attention_dtype": "float64"' in (tmp_path / "config.json").read_text()
    loaded = models.load_hub_model(str(tmp_path), "float32", False, random_init=False)
    models.set_attention_dtype(loaded, None)  # what the loaders do for model.attention_dtype=null
    assert not hasattr(loaded.config, "smd_attention_dtype")


def test_widening_never_narrows_and_is_refused_on_cuda(tmp_path):
    """A float64 copy (the float64 replay) stays float64 under a float32 setting; float64 is a CPU setting."""
    from omegaconf import OmegaConf

    from smd_cli.attention import kernels
    from smd_cli.config.validation import ConfigError
    from smd_cli.runs.model_loading import check_precision, set_precision

    model = tiny("float32").double()
    with torch.no_grad():
        assert model.get_output_embeddings()(torch.randn(2, 64, dtype=torch.float64)).dtype == torch.float64
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    with kernels.widened(torch.float32):
        assert kernels.widening(torch.float64) is None and kernels.causal(q, q, q, 0.3).dtype == torch.float64
    cfg = OmegaConf.create({"model": {"logits_dtype": "float64", "attention_dtype": None}})
    with pytest.raises(ConfigError, match="model.logits_dtype=float64 is a CPU setting"):
        check_precision(cfg, torch.device("cuda"))
    check_precision(cfg, torch.device("cpu"))
    set_precision(cfg, model := tiny())
    assert isinstance(model.get_output_embeddings(), models.WideLogits)
