"""Sampling-mask replay: with top-p / top-k the rollout records the log-prob of the distribution it drew from and a
cut per token that rebuilds its support exactly, and the learner scores log-probs, entropy and SMD's KL over that
support. Hand computations of the support (ties, top-k then top-p), the rebuild at adjacent floats, the sampler
against an independent truncation, parity to the float32 bound, the gap the old full-vocabulary metric hid, the
learner's terms against a hand formula, greedy and evaluation paths, and top_p = 1 unchanged bit for bit."""

import math

import pytest
import torch

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.evaluation import evaluate
from smd_cli.learner import Algorithm, learner_step
from smd_cli.rollout import draw, generate, sample
from smd_cli.sampling import support_cut, truncated_logprob
from smd_cli.scoring import response_hidden, response_logits, vocab_terms
from smd_cli.tasks.synthetic import NeedleRetrieval

PROBS = [0.4, 0.2, 0.2, 0.1, 0.05, 0.05]  # two ties: at 0.2 and at 0.05


def kept(logp, cut):
    return (logp >= cut[:, None]).squeeze(0).tolist()


@pytest.mark.parametrize("top_p, top_k, inside", [
    (0.5, 0, [1, 1, 1, 0, 0, 0]),    # 0.4 < 0.5, then 0.4 + 0.2 >= 0.5: the tied 0.2 comes along
    (0.95, 0, [1, 1, 1, 1, 1, 1]),   # 0.9 < 0.95: a 0.05 is needed, and its tie with it
    (1.0, 2, [1, 1, 1, 0, 0, 0]),    # the 2nd largest is 0.2, tied: three tokens
    (1.0, 4, [1, 1, 1, 1, 0, 0]),
    (0.75, 4, [1, 1, 1, 0, 0, 0]),   # top-4 renormalised: 0.444, 0.222, 0.222, 0.111; 0.667 < 0.75, 0.889 is not
])
def test_the_support_by_hand(top_p, top_k, inside):
    logp = torch.tensor([PROBS]).log()
    cut = support_cut(logp, top_p, top_k)
    assert kept(logp, cut) == [bool(v) for v in inside]
    mass = sum(p for p, i in zip(PROBS, inside) if i)
    tokens = torch.tensor([0])
    assert truncated_logprob(logp, cut, tokens).item() == pytest.approx(math.log(0.4 / mass), abs=1e-6)
    if mass < 1:  # the cut lies strictly between the smallest kept and the largest dropped log-prob
        smallest = min(math.log(p) for p, i in zip(PROBS, inside) if i)
        dropped = max(math.log(p) for p, i in zip(PROBS, inside) if not i)
        assert dropped < cut.item() < smallest and cut.item() == pytest.approx((smallest + dropped) / 2, abs=1e-6)


def test_nothing_truncated_gives_no_cut():
    logp = torch.randn(3, 10).log_softmax(-1)
    assert support_cut(logp, 1.0, 0) is None and support_cut(logp, 1.0, 10) is None


def test_the_cut_rebuilds_the_support_between_adjacent_floats():
    a = torch.tensor(-1.5)
    b = torch.nextafter(a, torch.tensor(-math.inf))  # the largest float below a: no float strictly between
    logp = torch.stack([torch.tensor(-0.5), a, b, torch.tensor(-3.0)])[None]
    cut = support_cut(logp, 1.0, 2)
    assert cut.item() == a.item()  # the midpoint would round onto a or b: the cut is a itself
    assert kept(logp, cut) == [True, True, False, False]


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
    tokens, logq, cut = sample(logits, 0.7, top_p, torch.rand(64, generator=torch.Generator().manual_seed(1)), top_k)
    want = truncate_by_hand(logits, 0.7, top_p, top_k)
    assert (want.gather(-1, tokens[:, None]) > 0).all()  # every draw inside the support
    torch.testing.assert_close(logq.double(), want.gather(-1, tokens[:, None]).squeeze(-1).log(), atol=2e-6, rtol=0)
    logp = (logits / 0.7).log_softmax(-1)
    assert torch.equal(logp >= cut[:, None], want > 0)  # the cut rebuilds the support exactly


def test_top_p_one_and_no_top_k_change_nothing_bit_for_bit():
    """The sampler's formula before the replay existed, written out: log_softmax at the drawn token, `draw` on its exp."""
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(2))
    uniforms = torch.rand(16, generator=torch.Generator().manual_seed(3))
    tokens, logp, cut = sample(logits, 0.9, 1.0, uniforms)
    before = torch.log_softmax(logits.float() / 0.9, dim=-1)
    assert cut is None and torch.equal(tokens, draw(before.exp(), uniforms))
    assert torch.equal(logp, before.gather(-1, tokens[:, None]).squeeze(-1))
    tokens, logp, cut = sample(logits, 0.0, 1.0, None)
    assert cut is None and torch.equal(logp, torch.log_softmax(logits, -1).gather(-1, logits.argmax(-1)[:, None]).squeeze(-1))


def prompts_of(tokenizer, n=3, g=2):
    task = NeedleRetrieval(prompt_tokens=40)
    return [task.encode_prompt(task.example("train", i), tokenizer)[i:] for i in range(n) for _ in range(g)]


def rollout(model, tokenizer, policy=None, **sampling):
    return generate(model, prompts_of(tokenizer), policy=policy, max_new_tokens=6, generator=torch.Generator().manual_seed(4),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sampling)


def full_vocab_logp(model, batch, evict_at=None, temperature=1.0):
    with torch.no_grad():
        logits = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, evict_at).float()
    return (logits / temperature).log_softmax(-1)  # [N, R, V]


def test_without_the_replay_the_old_metric_said_zero_while_the_gap_was_large(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer, top_p=0.9)
    real, tokens = batch.response_mask, batch.input_ids[:, batch.prompt_length:]
    assert batch.sampling_cut is not None and torch.isfinite(batch.sampling_cut[real]).all()
    logp = full_vocab_logp(tiny_model, batch)
    kept_mass = logp.exp().masked_fill(logp < batch.sampling_cut[..., None], 0).sum(-1)  # [N, R]
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
                           batch.prompt_length).detach(), tokens, real, cut=batch.sampling_cut)["logp"]
    assert (replayed - batch.logprobs)[real].abs().max() <= 1e-5


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 0.9, 0), (0.8, 1.0, 20), (0.0, 0.9, 20)])
def test_smd_parity_to_the_float32_bound_under_truncation(tiny_model, tiny_tokenizer, temperature, top_p, top_k):
    """SMD's learner (shadow replay, micro-batches, vocabulary chunks) scores the sampler's truncated log-probs;
    greedy (temperature 0) records its support too, scored at temperature 1."""
    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5, sink=2, window=6), temperature=temperature, top_p=top_p,
                    top_k=top_k)
    assert batch.sampling_cut is not None
    if temperature == 0:
        assert torch.equal(batch.input_ids[:, batch.prompt_length:][batch.response_mask],
                           full_vocab_logp(tiny_model, batch, batch.evict_at).argmax(-1)[batch.response_mask])
    algo = Algorithm("smd", temperature=temperature, micro_batch_size=4, logits_chunk=5)
    metrics = learner_step(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), batch, torch.zeros(6), algo)
    assert metrics["mismatch/max_abs_diff"] <= 1e-5
    assert metrics["mismatch/dense_max_abs_diff"] > 1e-3  # the dense teacher still sees something else


def test_entropy_and_kl_over_the_support_by_hand():
    """`vocab_terms` with a cut against the truncated distributions written out: q_s and q_t are the student's and
    the teacher's probabilities restricted to the student's support {log p_s >= cut} and renormalised."""
    generator = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden, teacher = torch.randn(2, 3, 8, generator=generator), torch.randn(2, 3, 8, generator=generator)
    tokens, mask = torch.randint(0, 30, (2, 3), generator=generator), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        log_s, log_t = (head(hidden) / 0.7).log_softmax(-1), (head(teacher) / 0.7).log_softmax(-1)
    cut = log_s.sort(-1, descending=True).values[..., 9] - 1e-3  # ten tokens inside
    inside = (log_s >= cut[..., None]).scatter(-1, tokens[..., None], True)
    q_s = log_s.exp() * inside / (log_s.exp() * inside).sum(-1, keepdim=True)
    q_t = log_t.exp() * inside / (log_t.exp() * inside).sum(-1, keepdim=True)
    entropy = -(q_s * q_s.clamp(min=1e-30).log()).sum(-1)
    kl = (q_t * (q_t.clamp(min=1e-30).log() - q_s.clamp(min=1e-30).log())).sum(-1)
    out = vocab_terms(head, hidden, tokens, mask, 0.7, teacher, chunk=2, cut=cut)
    torch.testing.assert_close(out["logp"][mask], q_s.gather(-1, tokens[..., None]).squeeze(-1).log()[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"][mask], entropy[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["kl"][mask], kl[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["teacher_logp"][mask], q_t.gather(-1, tokens[..., None]).squeeze(-1).log()[mask], atol=1e-5, rtol=0)
    assert (out["kl"][mask] > 1e-3).all()  # the comparison can fail: the two distributions differ


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
