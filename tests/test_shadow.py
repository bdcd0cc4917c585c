"""The shadow-mask encoding and its replay: a hand-checked mask, gradients against an explicit-mask
reference (eager attention fed the rollout's own visibility log, not the encoding). The flex replay's parity:
tests/test_flex_compiled.py."""

import pytest
import torch
from transformers import AttentionInterface
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

from smd_cli.attention.dispatch import use_smd_attention
from smd_cli.attention.shadow import decode_visibility, visibility
from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_logits
from smd_cli.model.build import build_tiny_model
from smd_cli.rollout.sampler import generate
from smd_cli.rollout.sampling import token_logprobs

REFERENCE = "test_explicit_mask"


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_tiny_model(len(tiny_tokenizer), seed=1).eval()


@pytest.fixture(scope="module")
def batch(model, tiny_tokenizer):
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (30, 44, 37)]
    return generate(
        model, prompts, policy=H2O(compression=0.5, sink=1, window=4), max_new_tokens=8,
        generator=torch.Generator().manual_seed(2), eos_token_id=2, pad_token_id=0, record_visibility=True,
    )


def test_encoding_by_hand():
    # T = 6, P = 3: column 0 is padding, column 1 evicted at prefill (evict_at = P), column 3 evicted after
    # the query at column 4 attended (evict_at = 5), the rest never (sentinel T).
    evict_at = torch.tensor([[[0, 3, 6, 5, 6, 6]]], dtype=torch.int32)
    mask = visibility(evict_at, torch.arange(6))[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],  # padding row: only itself
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],  # the last prompt row (first response token's logits) sees the whole prompt
        [0, 0, 1, 1, 0, 0],  # first response query: column 1 is gone
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 0, 1, 1],  # column 3 evicted after column 4
    ]
    slots = torch.tensor([[[4, -1, 2]]])  # cached entries in any order, -1 = empty slot
    assert visibility(evict_at, torch.tensor([5]), slots)[0, 0].int().tolist() == [[1, 0, 1]]


def _explicit_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Reference: eager attention with an explicit per-layer, per-head additive mask [N, H, T, T]."""
    allowed = kwargs["explicit_masks"][module.layer_idx].repeat_interleave(module.num_key_value_groups, dim=1)
    additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, float("-inf"))
    return eager_attention_forward(module, query, key, value, additive, scaling=scaling, dropout=dropout)


AttentionInterface.register(REFERENCE, _explicit_mask_attention)


def _grads(model, loss_of_logits, forward):
    model.zero_grad()
    loss_of_logits(forward()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


def test_replay_gradients_match_an_explicit_mask_reference(model, batch):
    width, prompt_length = batch.input_ids.shape[1], batch.prompt_length
    recorded = batch.visibility.clone()  # [N, L, Hkv, T, T] what the rollout's queries saw
    recorded[..., width - 1, :] = False  # the last token was never fed: let it see only itself
    recorded |= torch.eye(width, dtype=torch.bool)
    masks = [recorded[:, layer] for layer in range(recorded.shape[1])]
    tokens = batch.input_ids[:, prompt_length:]
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(0))

    def loss(logits):
        return (token_logprobs(logits, tokens) * weights)[batch.response_mask].sum() + 1e-2 * logits.square().mean()

    def reference():
        position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        model.config._attn_implementation = REFERENCE
        try:
            out = model(input_ids=batch.input_ids, position_ids=position_ids, explicit_masks=masks, logits_to_keep=width - prompt_length + 1)
        finally:
            use_smd_attention(model)
        return out.logits[:, :-1]

    shadow = _grads(model, loss, lambda: response_logits(model, batch.input_ids, batch.attention_mask, prompt_length, batch.evict_at))
    expected = _grads(model, loss, reference)
    dense = _grads(model, loss, lambda: response_logits(model, batch.input_ids, batch.attention_mask, prompt_length))
    for name in expected:
        torch.testing.assert_close(shadow[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    worst = max((dense[n] - expected[n]).abs().max() for n in expected)
    assert worst > 1e-4, "the dense gradients should differ: the mask matters"


def test_replay_needs_a_matching_mask(model, batch):
    with pytest.raises(ValueError, match="evict_at"):
        response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at[..., :-1])
    with pytest.raises(ValueError, match="backend must be"):
        response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at, backend="cuda")


def test_decoded_mask_never_hides_a_token_from_itself_nor_shows_the_future(batch):
    decoded = decode_visibility(batch.evict_at)
    width = decoded.shape[-1]
    assert decoded.diagonal(dim1=-2, dim2=-1).all()
    assert not (decoded & ~torch.ones(width, width, dtype=torch.bool).tril()).any()


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    tokens = torch.tensor([[0]])
    expected = torch.log_softmax(logits / 0.5, -1)[0, 0, 0]
    assert torch.isclose(token_logprobs(logits, tokens, 0.5)[0, 0], expected)
    assert torch.equal(token_logprobs(logits, tokens, 0.0), token_logprobs(logits, tokens, 1.0))


def test_snapkv_rollout_keeps_full_prompt_for_the_first_token(model, batch, tiny_tokenizer):
    """Prefill eviction is recorded as evict_at = P: the first response token saw every prompt token."""
    snap = generate(
        model, [[5, 6, 7, 8] * 8], policy=SnapKV(compression=0.5, sink=2, window=4), max_new_tokens=3,
        generator=torch.Generator().manual_seed(0), eos_token_id=2, pad_token_id=0,
    )
    prompt_length = snap.prompt_length
    evicted = snap.evict_at[..., :prompt_length] == prompt_length
    assert evicted.sum(-1).eq(prompt_length - 16).all()  # ceil(0.5 * 32) = 16 kept per (layer, KV head)
    assert (snap.evict_at[..., :prompt_length][~evicted] == snap.input_ids.shape[1]).all()


def test_replay_rejects_a_broken_encoding(model, batch):
    broken = batch.evict_at.clone()
    broken[0, 0, 0, batch.prompt_length - 1] = batch.prompt_length - 1  # a prompt key gone before the prompt ends
    with pytest.raises(ValueError, match="hides a real key"):
        response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, broken)
