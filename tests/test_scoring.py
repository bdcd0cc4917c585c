"""`vocab_terms`: the per-token log-prob, entropy and KL(teacher || student) computed a chunk of tokens at a
time from hidden states, against hand values and against full-vocabulary log_softmax references; and its
memory: the vocabulary costs one chunk, whatever the number of tokens."""

import math

import pytest
import torch

from smd_cli.learner.forward import chunk_tokens, vocab_terms


def identity_head(vocab: int) -> torch.nn.Linear:
    """An LM head whose logits are the hidden state itself (hidden size = vocabulary)."""
    head = torch.nn.Linear(vocab, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(vocab))
    return head


def test_kl_entropy_and_logp_by_hand():
    head = identity_head(2)
    teacher = torch.tensor([[[0.0, math.log(3.0)]]])  # probs 0.25, 0.75
    student = torch.zeros(1, 1, 2, requires_grad=True)  # probs 0.5, 0.5
    terms = vocab_terms(head, student, torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool), teacher=teacher)
    assert terms["kl"].item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)
    assert terms["logp"].item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert terms["teacher_logp"].item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert terms["entropy"].item() == pytest.approx(math.log(2.0), abs=1e-6)
    terms["kl"].sum().backward()
    # d KL / d student logits = softmax(student) - p_teacher (the teacher is a constant)
    assert student.grad.flatten().tolist() == pytest.approx([0.5 - 0.25, 0.5 - 0.75], abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunks_match_a_full_vocabulary_reference(chunk):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(3, 5, 8, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 5, 8, generator=generator)
    tokens = torch.randint(0, 50, (3, 5), generator=generator)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False  # a short response: nothing is scored there
    weights = torch.randn(3, 5, generator=generator)

    terms = vocab_terms(head, hidden, tokens, mask, temperature=0.7, teacher=teacher, chunk=chunk)
    ((terms["logp"] + 0.3 * terms["kl"]) * weights).sum().backward()
    got = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    log_s = torch.log_softmax(head(hidden) / 0.7, dim=-1)  # [3, 5, 50]: the whole vocabulary at once
    log_t = torch.log_softmax(head(teacher) / 0.7, dim=-1).detach()
    logp = log_s.gather(-1, tokens[..., None]).squeeze(-1) * mask
    kl = (log_t.exp() * (log_t - log_s)).sum(-1) * mask
    ((logp + 0.3 * kl) * weights).sum().backward()
    torch.testing.assert_close(terms["logp"], logp, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(terms["kl"], kl, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(terms["entropy"], -(log_s.exp() * log_s).sum(-1).detach() * mask, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], head.weight.grad, atol=1e-6, rtol=1e-5)
    assert float(terms["logp"].detach()[0, 3:].abs().sum()) == 0.0


def test_chunk_size_follows_the_vocabulary():
    assert chunk_tokens(151936) == (1 << 23) // 151936 == 55
    assert chunk_tokens(541) == (1 << 23) // 541
    assert chunk_tokens(151936, 7) == 7


@pytest.mark.parametrize("policy", ["dense", "snapkv", "h2o"])
def test_a_prompt_its_samples_share_is_computed_once(tiny_tokenizer, policy):
    """The learner computes a prompt once for its G samples (GRPO's rows, side by side): hidden states, the SMD
    teacher's, and gradients equal each row's own forward (a batch of one: nothing shared), to float rounding."""
    from smd_cli.eviction.h2o import H2O
    from smd_cli.eviction.snapkv import SnapKV
    from smd_cli.learner.forward import response_hidden, shadow_and_teacher_hidden
    from smd_cli.model.build import build_tiny_model
    from smd_cli.rollout.sampler import generate

    model = build_tiny_model(len(tiny_tokenizer), seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (30, 22)]
    prompts = [p for p in prompts for _ in range(3)]  # 2 prompts x 3 samples, the second left-padded
    make = {"dense": lambda: None, "snapkv": lambda: SnapKV(0.5, sink=2, window=4), "h2o": lambda: H2O(0.5, window=4)}[policy]
    b = generate(model, prompts, policy=make(), max_new_tokens=6, generator=torch.Generator().manual_seed(1), eos_token_id=2,
                 pad_token_id=0, measure_dense_kv=False)
    P, mask = b.prompt_length, b.response_mask[..., None]
    rows = []
    attention = model.model.layers[0].self_attn  # the layer's calls skip module hooks (`layer_pass`); its attention's do not
    hook = attention.register_forward_pre_hook(lambda m, args, kwargs: rows.append((args[0] if args else kwargs["hidden_states"]).shape[:2]),
                                               with_kwargs=True)
    model.train()
    shared = response_hidden(model, b.input_ids, b.attention_mask, P, b.evict_at)
    hook.remove()
    assert rows == [(2, P), (6, b.input_ids.shape[1] - P)]  # the 2 prompts once, then the 6 rows' responses
    (shared.sin() * mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = torch.cat([response_hidden(model, b.input_ids[i : i + 1], b.attention_mask[i : i + 1], P,
                                       None if b.evict_at is None else b.evict_at[i : i + 1]) for i in range(6)])
    (alone.sin() * mask).sum().backward()
    torch.testing.assert_close(shared * mask, alone * mask, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
    if b.evict_at is not None:  # SMD's two views on one shared prompt
        shadow, teacher = shadow_and_teacher_hidden(model, b.input_ids, b.attention_mask, P, b.evict_at)
        dense_alone = torch.cat([response_hidden(model, b.input_ids[i : i + 1], b.attention_mask[i : i + 1], P) for i in range(6)])
        torch.testing.assert_close(shadow * mask, alone * mask, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(teacher * mask, dense_alone.detach() * mask, atol=1e-5, rtol=1e-5)
        assert not teacher.requires_grad
