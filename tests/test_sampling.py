"""Sampling-mask replay: with top-p / top-k the rollout records the log-prob of the distribution it drew from and
the kept token set itself, and every learner view scores log-probs, entropy and SMD's KL over that set. Hand
computations of the support (ties, top-k then top-p, top_p within rounding of 1), the sampler against an
independent truncation, the bound on the recorded set, parity to the float32 bound, a dense view over the
sampler's set (not its own) by hand, the gap the old full-vocabulary metric hid, the learner's terms against a
hand formula, greedy and evaluation paths, and the one log-prob formula of the sampler and the learner."""

import math

import pytest
import torch

from smd_cli.evaluation.batch import evaluate
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_hidden, response_logits, vocab_terms
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.rollout.sampler import draw, generate, sample
from smd_cli.rollout.sampling import MAX_SUPPORT, Kept, Support, SupportLog, choose, inside, kept_mask, token_logprobs
from smd_cli.tasks.synthetic import NeedleRetrieval

PROBS = [0.4, 0.2, 0.2, 0.1, 0.05, 0.05]  # two ties: at 0.2 and at 0.05


def kept(logp, top_p, top_k):
    return kept_mask(choose(logp, top_p, top_k), logp.shape[-1]).squeeze(0).tolist()


@pytest.mark.parametrize("top_p, top_k, inside", [
    (0.5, 0, [1, 1, 1, 0, 0, 0]),    # 0.4 < 0.5, then 0.4 + 0.2 >= 0.5: the tied 0.2 comes along
    (0.95, 0, [1, 1, 1, 1, 1, 1]),   # 0.9 < 0.95: a 0.05 is needed, and its tie with it
    (1.0, 2, [1, 1, 1, 0, 0, 0]),    # the 2nd largest is 0.2, tied: three tokens
    (1.0, 4, [1, 1, 1, 1, 0, 0]),
    (0.75, 4, [1, 1, 1, 0, 0, 0]),   # top-4 renormalised: 0.444, 0.222, 0.222, 0.111; 0.667 < 0.75, 0.889 is not
])
def test_the_support_by_hand(top_p, top_k, inside):
    logp = torch.tensor([PROBS]).log()
    assert kept(logp, top_p, top_k) == [bool(v) for v in inside]
    mass = sum(p for p, i in zip(PROBS, inside) if i)
    _, logq, found = sample(logp, 1.0, top_p, torch.tensor([0.0]), top_k)  # u = 0 draws the most probable token
    assert found.count.item() == sum(inside) and logq.item() == pytest.approx(math.log(0.4 / mass), abs=1e-6)


def test_nothing_truncated_gives_no_support():
    logp = torch.randn(3, 10).log_softmax(-1)
    assert choose(logp, 1.0, 0) is None and choose(logp, 1.0, 10) is None


def test_top_k_with_top_p_within_rounding_of_one_keeps_the_top_k():
    """top_k = 5, top_p = 1 - 6e-8: the whole top-k (all it can keep), never more. Before, the float32 cumulative sum
    over the zeroed tail stayed below top_p times the kept mass on this row (seed 92), and the support was the
    whole vocabulary of 1000."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(92)) * 3
    for top_p in (1 - 6e-8, 1 - 1e-7, 0.9999999):
        tokens, logq, found = sample(logits, 1.0, top_p, torch.tensor([0.5]), 5)
        assert found.count.item() == 5 and kept_mask(found, 1000).sum() == 5
        top5 = logits.topk(5).indices[0]
        assert tokens.item() in top5.tolist()
        assert logq.item() == pytest.approx((logits[0, tokens] - logits[0, top5].logsumexp(-1)).item(), abs=1e-6)


def truncate_by_hand(logits, temperature, top_p, top_k):
    """The truncated distribution written out row by row: sort, keep the top k (and ties), then the prefix reaching
    top_p of what is left (and ties), renormalise. [N, V] probabilities."""
    probs = (logits / temperature).softmax(-1).double()
    out = torch.zeros_like(probs)
    for row, p in enumerate(probs):
        order = sorted(range(len(p)), key=lambda v: -p[v].item())
        allowed = order if top_k == 0 else [v for v in order if p[v] >= p[order[top_k - 1]]]
        total, chosen = sum(p[v].item() for v in allowed), []
        for v in allowed:
            if sum(p[u].item() for u in chosen) >= top_p * total:
                break
            chosen.append(v)
        last = min(p[v].item() for v in chosen)
        chosen = [v for v in allowed if p[v].item() >= last]  # ties with the last one kept
        out[row, chosen] = p[chosen] / p[chosen].sum()
    return out


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (1.0, 7), (0.9, 20)])
def test_sample_draws_inside_and_records_the_truncated_logprob(top_p, top_k):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 2
    tokens, logq, found = sample(logits, 0.7, top_p, torch.rand(64, generator=torch.Generator().manual_seed(1)), top_k)
    want = truncate_by_hand(logits, 0.7, top_p, top_k)
    assert (want.gather(-1, tokens[:, None]) > 0).all()  # every draw inside the support
    torch.testing.assert_close(logq.double(), want.gather(-1, tokens[:, None]).squeeze(-1).log(), atol=2e-6, rtol=0)
    assert torch.equal(kept_mask(found, 50), want > 0)  # the recorded set is the support


def test_the_sampler_records_the_learners_formula_bit_for_bit():
    """Without truncation the sampler records `logit - logsumexp` of logits / T at the drawn token, the formula of
    the learner (`scoring._terms` through `sampling.logprob`), not float32 `log_softmax`, which rounds otherwise
    (2-3e-5 on SmolLM2's vocabulary); `draw` on its exp."""
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(2)) * 8
    uniforms = torch.rand(16, generator=torch.Generator().manual_seed(3))
    tokens, logp, found = sample(logits, 0.9, 1.0, uniforms)
    scaled = logits / 0.9
    log_z = scaled.logsumexp(-1, keepdim=True)
    assert found is None and torch.equal(tokens, draw((scaled - log_z).exp(), uniforms))
    assert torch.equal(logp, scaled.gather(-1, tokens[:, None]).squeeze(-1) - log_z.squeeze(-1))
    head = torch.nn.Linear(40, 40, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(40))  # head(hidden) = hidden: the learner's logits are these logits
    learner = vocab_terms(head, logits[None], tokens[None], torch.ones(1, 16, dtype=torch.bool), 0.9)["logp"][0]
    assert torch.equal(learner, logp)
    tokens, logp, found = sample(logits, 0.0, 1.0, None)
    assert found is None and torch.equal(logp, logits.gather(-1, logits.argmax(-1)[:, None]).squeeze(-1) - logits.logsumexp(-1))


def prompts_of(tokenizer, n=3, g=2):
    task = NeedleRetrieval(prompt_tokens=40)
    return [task.encode_prompt(task.example("train", i), tokenizer)[i:] for i in range(n) for _ in range(g)]


def rollout(model, tokenizer, policy=None, **sampling):
    return generate(model, prompts_of(tokenizer), policy=policy, max_new_tokens=6, generator=torch.Generator().manual_seed(4),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sampling)


def support_mask(batch, vocab):
    """[N, R, V] bool: the recorded kept set of every response token (and the token itself)."""
    support, tokens = batch.sampling_support, batch.input_ids[:, batch.prompt_length:]
    flat = inside(support.ids, support.start.reshape(-1), support.count.reshape(-1), tokens.reshape(-1), vocab, support.width)
    return flat.view(*tokens.shape, vocab)


def full_vocab_logp(model, batch, evict_at=None, temperature=1.0):
    with torch.no_grad():
        logits = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, evict_at).float()
    return (logits / temperature).log_softmax(-1)  # [N, R, V]


def test_without_the_replay_the_old_metric_said_zero_while_the_gap_was_large(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer, top_p=0.9)
    real, tokens = batch.response_mask, batch.input_ids[:, batch.prompt_length:]
    assert batch.sampling_support is not None and (batch.sampling_support.count[real] > 0).all()
    logp = full_vocab_logp(tiny_model, batch)
    kept_mass = logp.exp().masked_fill(~support_mask(batch, logp.shape[-1]), 0).sum(-1)  # [N, R]
    assert (kept_mass[real] < 0.999).all()  # top-p cut something at every token
    # The old metric: the learner's full-vocabulary log-prob against the sampler's full-vocabulary log-prob (what
    # the rollout used to record) at the drawn token: zero, up to rounding.
    learner_full = vocab_terms(tiny_model.get_output_embeddings(), response_hidden(tiny_model, batch.input_ids, batch.attention_mask,
                               batch.prompt_length).detach(), tokens, real)["logp"]
    sampler_full = batch.logprobs + kept_mass.log()  # log q = log p - log(kept mass)
    assert (learner_full - sampler_full)[real].abs().max() <= 1e-5
    # The truth: the sampler drew from q, the learner differentiates p; KL(q || p) = -log(kept mass) per token.
    true_kl = (-kept_mass.log())[real]
    assert true_kl.mean() > 0.05 and (batch.logprobs - learner_full)[real].abs().mean() > 0.05
    # With the replay: the learner scores the same support, to the float32 bound.
    replayed = vocab_terms(tiny_model.get_output_embeddings(), response_hidden(tiny_model, batch.input_ids, batch.attention_mask,
                           batch.prompt_length).detach(), tokens, real, support=batch.sampling_support)["logp"]
    assert (replayed - batch.logprobs)[real].abs().max() <= 1e-5


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 0.9, 0), (0.8, 1.0, 20), (0.0, 0.9, 20)])
def test_smd_parity_to_the_float32_bound_under_truncation(tiny_model, tiny_tokenizer, temperature, top_p, top_k):
    """SMD's learner (shadow replay, micro-batches, vocabulary chunks) scores the sampler's truncated log-probs;
    greedy (temperature 0) records its support too, scored at temperature 1."""
    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5, sink=2, window=6), temperature=temperature, top_p=top_p,
                    top_k=top_k)
    assert batch.sampling_support is not None
    if temperature == 0:
        assert torch.equal(batch.input_ids[:, batch.prompt_length:][batch.response_mask],
                           full_vocab_logp(tiny_model, batch, batch.evict_at).argmax(-1)[batch.response_mask])
    algo = Algorithm("smd", temperature=temperature, micro_batch_size=4, logits_chunk=5)
    metrics = learner_step(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), batch, torch.zeros(6), algo)
    assert metrics["mismatch/max_abs_diff"] <= 1e-5
    assert metrics["mismatch/dense_max_abs_diff"] > 1e-3  # the dense teacher still sees something else


def test_entropy_and_kl_over_the_support_by_hand():
    """`vocab_terms` with a recorded support against the truncated distributions written out: q_s and q_t are the
    student's and the teacher's probabilities restricted to the recorded set and renormalised."""
    generator = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(8, 30, bias=False)
    with torch.no_grad():  # seeded here, not by whatever ran before in the process
        head.weight.copy_(torch.randn(30, 8, generator=generator) / 8**0.5)
    hidden, teacher = torch.randn(2, 3, 8, generator=generator), torch.randn(2, 3, 8, generator=generator)
    tokens, mask = torch.randint(0, 30, (2, 3), generator=generator), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        log_s, log_t = (head(hidden) / 0.7).log_softmax(-1), (head(teacher) / 0.7).log_softmax(-1)
    order = torch.randperm(30, generator=generator)[:10]  # the recorded sets: the first `count` of these ten tokens
    count = torch.tensor([[10, 4, 0], [7, 10, 1]], dtype=torch.int32)
    inside = torch.zeros(2, 3, 30, dtype=torch.bool)
    for n in range(2):
        for r in range(3):
            inside[n, r, order[: count[n, r]]] = True
            inside[n, r, tokens[n, r]] = True  # the drawn token always inside
    support = Support(order.int().repeat(6), torch.arange(6).view(2, 3) * 10, count, 10)
    q_s = log_s.exp() * inside / (log_s.exp() * inside).sum(-1, keepdim=True)
    q_t = log_t.exp() * inside / (log_t.exp() * inside).sum(-1, keepdim=True)
    entropy = -(q_s * q_s.clamp(min=1e-30).log()).sum(-1)
    kl = (q_t * (q_t.clamp(min=1e-30).log() - q_s.clamp(min=1e-30).log())).sum(-1)
    out = vocab_terms(head, hidden, tokens, mask, 0.7, teacher, chunk=2, support=support)
    torch.testing.assert_close(out["logp"][mask], q_s.gather(-1, tokens[..., None]).squeeze(-1).log()[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"][mask], entropy[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["kl"][mask], kl[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["teacher_logp"][mask], q_t.gather(-1, tokens[..., None]).squeeze(-1).log()[mask], atol=1e-5, rtol=0)
    wide = mask & (inside.sum(-1) >= 4)  # a set of one or two tokens leaves the two distributions (nearly) alike
    assert wide.sum() >= 3 and (out["kl"][wide] > 1e-3).all()  # the comparison can fail: the two distributions differ


def test_evaluation_and_training_rollouts_take_top_k(tiny_model, tiny_tokenizer):
    """top_k = 1 samples the argmax: sampled evaluation with it gives the greedy completions."""
    task = NeedleRetrieval(prompt_tokens=40)
    examples = [task.example("test", i) for i in range(4)]
    greedy, _ = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=6, temperature=0.0, progress=False)
    top1, _ = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=6, temperature=1.0, top_k=1, seed=3, progress=False)
    sampled, _ = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=6, temperature=1.0, seed=3, progress=False)
    assert [r["completion"] for r in top1] == [r["completion"] for r in greedy]
    assert [r["completion"] for r in sampled] != [r["completion"] for r in greedy]  # the comparison can fail
    batch = rollout(tiny_model, tiny_tokenizer, top_k=1)
    assert (batch.logprobs[batch.response_mask] == 0).all()  # one token in the support: probability 1


def test_smd_train_with_top_p_keeps_parity_through_the_stage(tmp_path):
    """`smd train sampling.top_p=0.9 sampling.top_k=30 algo=smd`: every step's learner matches its sampler to the float32
    bound, and the held-out evaluation samples with the same truncation."""
    import json

    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.stages import train

    overrides = ["algo=smd", "sampling.top_p=0.9", "sampling.top_k=30", "steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=4",
                 "eval.num_prompts=4", "task.prompt_tokens=48", "model.warmstart.steps=5", "progress=false", "device=cpu",
                 f"+run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        summary = train.run(compose(config_name="train", overrides=overrides))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["mismatch/max_abs_diff"] <= 1e-5 for r in rows)
    assert all(r["mismatch/dense_max_abs_diff"] > 1e-3 for r in rows)
    assert summary["status"] == "completed"


def test_a_dense_view_scores_the_samplers_kept_set_by_hand():
    """V = 1000, top_p = 0.9, logits given by hand. The sampler (p) keeps tokens 0 and 1 (0.6 + 0.35) and draws y = 1;
    the dense view (p_d, flatter) puts 0.004 on token 0 and 0.002 on y. Over the sampler's set its truncated
    log-prob is log(0.002 / 0.006) = -1.0986. Rebuilding the set from the sampler's probability threshold with the
    dense view's own log-probs (as before) kept {y} alone: log-prob 0, no gradient, every ratio 1 / q(y)."""
    sampler = torch.full((1, 1000), 0.05 / 998).index_put_((torch.tensor([0, 0]), torch.tensor([0, 1])), torch.tensor([0.6, 0.35])).log()
    dense = torch.full((1, 1000), 0.994 / 998).index_put_((torch.tensor([0, 0]), torch.tensor([0, 1])), torch.tensor([0.004, 0.002])).log()
    tokens, logq, kept = sample(sampler, 1.0, 0.9, torch.tensor([0.9]))  # the rollout's sampler
    assert tokens.tolist() == [1] and kept.count.tolist() == [2]
    assert logq.item() == pytest.approx(math.log(0.35 / 0.95), abs=1e-6)
    log = SupportLog(1, 1, "cpu")  # the rollout's record of it
    log.add(0, kept, torch.tensor([True]))
    support, stats = log.support(1)
    assert stats == {"rollout/support_size_mean": 2.0, "rollout/support_capped_fraction": 0.0}
    head = torch.nn.Linear(1000, 1000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(1000))  # head(hidden) = hidden: the view's logits are the hand-given ones
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = vocab_terms(head, dense[None], tokens[None], mask, 1.0, teacher=sampler[None], support=support)
    assert out["logp"].item() == pytest.approx(math.log(0.002 / 0.006), abs=1e-5)
    assert out["teacher_logp"].item() == pytest.approx(math.log(0.35 / 0.95), abs=1e-5)  # the teacher over the same set
    full = token_logprobs(dense[None], tokens[None], 1.0, support)  # the path of logits that exist (physical learner)
    assert full.item() == pytest.approx(math.log(0.002 / 0.006), abs=1e-5)


def test_naive_sparse_learner_scores_the_dense_view_over_the_samplers_set(tiny_model, tiny_tokenizer):
    """`learner_step` of naive_sparse (dense view) on an evicting top-p rollout: its mismatch statistics against the
    sampler are those of the dense logits truncated to the SAMPLER's kept set, that set found by hand from the
    shadow replay's logits (the sampler's, to rounding): sort, the prefix reaching 0.9, ties."""
    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5, sink=2, window=6), top_p=0.9)
    real, tokens = batch.response_mask, batch.input_ids[:, batch.prompt_length:]
    shadow, dense = full_vocab_logp(tiny_model, batch, batch.evict_at), full_vocab_logp(tiny_model, batch)
    ordered = shadow.sort(-1, descending=True).values
    needed = (ordered.exp().cumsum(-1) - ordered.exp()) < 0.9  # mass ahead of each position
    last = ordered.gather(-1, needed.sum(-1, keepdim=True) - 1)
    by_hand = shadow >= last  # [N, R, V]
    assert torch.equal(by_hand[real], support_mask(batch, shadow.shape[-1])[real])  # the recorded set is the sampler's
    want = dense.gather(-1, tokens[..., None]).squeeze(-1) - dense.masked_fill(~by_hand, -math.inf).logsumexp(-1)
    diff = (want - batch.logprobs)[real]
    metrics = learner_step(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), batch, torch.zeros(6), Algorithm("naive_sparse"))
    assert metrics["mismatch/max_abs_diff"] == pytest.approx(diff.abs().max().item(), abs=1e-5)
    assert metrics["mismatch/mean_abs_diff"] == pytest.approx(diff.abs().mean().item(), abs=1e-5)
    # The comparison can fail: the old rebuild, the dense view's own set at the sampler's threshold (a cut between the
    # smallest kept and the largest dropped log-prob), gives other numbers.
    cut = (last + shadow.masked_fill(by_hand, -math.inf).amax(-1, keepdim=True)) / 2
    own = (dense >= cut).scatter(-1, tokens[..., None], True)
    old = dense.gather(-1, tokens[..., None]).squeeze(-1) - dense.masked_fill(~own, -math.inf).logsumexp(-1)
    assert abs((old - batch.logprobs)[real].abs().mean() - diff.abs().mean()) > 1e-3


def test_the_recorded_set_is_bounded_and_says_so(tiny_model, tiny_tokenizer):
    """A flat distribution with top_p = 0.999 would keep most of the vocabulary: the sampler keeps the MAX_SUPPORT
    most probable tokens, draws from them, records them, says so (a warning, `rollout/support_capped_fraction`), and
    the learner scores the same set. top_k above the bound is refused."""
    vocab = 2000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(6)) * 0.01
    tokens, logq, kept = sample(logits, 1.0, 0.999, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert kept.count.tolist() == [MAX_SUPPORT] * 3 and kept.capped.all()
    top = logits.topk(MAX_SUPPORT).indices
    assert (top == tokens[:, None]).any(-1).all()
    want = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.gather(-1, top).logsumexp(-1)
    torch.testing.assert_close(logq, want, atol=1e-6, rtol=0)
    with pytest.warns(RuntimeWarning, match=f"reached its bound of {MAX_SUPPORT} tokens"):
        batch = rollout(tiny_model, tiny_tokenizer, top_p=0.9999999)
    assert batch.stats["rollout/support_capped_fraction"] > 0 and batch.sampling_support.width <= MAX_SUPPORT
    with pytest.raises(ValueError, match=f"top_k must be an integer in \\[0, {MAX_SUPPORT}\\]"):
        rollout(tiny_model, tiny_tokenizer, top_k=MAX_SUPPORT + 1)


def test_sampler_and_learner_agree_bit_for_bit_on_a_real_sized_vocabulary():
    """SmolLM2's vocabulary (49152) and logits of its size (row maxima near 30): given the same logits, the learner's
    `vocab_terms` returns the sampler's recorded log-probs bit for bit, untruncated and over a top-p set. Float32
    `log_softmax` (the sampler's formula before) misses the learner's `logit - logsumexp` by rounding there."""
    generator = torch.Generator().manual_seed(8)
    head = torch.nn.Linear(64, 49152, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(49152, 64, generator=generator) * 0.6)
        hidden = torch.randn(1, 24, 64, generator=generator)
        logits = head(hidden[0])  # [24, V], the rows the learner's one chunk computes too
    assert 20 < logits.amax(-1).mean() < 40
    uniforms, mask = torch.rand(24, generator=generator), torch.ones(1, 24, dtype=torch.bool)
    for top_p in (1.0, 0.9):
        tokens, recorded, kept = sample(logits, 1.0, top_p, uniforms)
        support = None
        if kept is not None:
            log = SupportLog(1, 24, "cpu")
            for r in range(24):  # one response of 24 tokens
                log.add(r, Kept(kept.ids[r : r + 1], kept.count[r : r + 1], kept.capped[r : r + 1]), torch.tensor([True]))
            support = log.support(24)[0]
        with torch.no_grad():
            learner = vocab_terms(head, hidden, tokens[None], mask, 1.0, support=support)["logp"][0]
        assert torch.equal(learner, recorded), (top_p, (learner - recorded).abs().max())
        if top_p == 1.0:  # the comparison can fail: the old record, float32 log_softmax, is another rounding
            assert not torch.equal(torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1), learner)
