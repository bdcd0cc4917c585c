"""`learner_step` against the formulas of DESIGN.md section 4, written out by hand with the same log-probs:
each algorithm's loss, SMD's ratio parity under the shadow mask, the stop-gradient on the dense teacher,
Sparse-RL's weights, masks and vetoes, the empty-batch skip, and the divergence guard."""

import copy
import math

import pytest
import torch

from smd_cli import learner
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner import Algorithm, TrainingDiverged, learner_step
from smd_cli.rollout import generate
from smd_cli.losses import token_logprobs
from smd_cli.scoring import response_logits
from smd_cli.tasks.synthetic import NeedleRetrieval

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.0, 0.5, -2.0])  # [N]: 2 prompts x 4 generations


def rollout(model, tokenizer, policy=None, max_new_tokens=5):
    task = NeedleRetrieval(prompt_tokens=32)
    prompts = [task.encode_prompt(task.example("train", i), tokenizer) for i in range(2) for _ in range(4)]
    return generate(model, prompts, policy=policy, max_new_tokens=max_new_tokens, generator=torch.Generator().manual_seed(0),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


@torch.no_grad()
def logits_of(model, batch, shadow=False):
    """The learner's view of the batch, [N, R, V]: dense, or replaying the rollout's shadow mask."""
    evict_at = batch.evict_at if shadow else None
    return response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, evict_at)


def tokens_of(batch):
    return batch.input_ids[:, batch.prompt_length :]  # [N, R]


def logp_of(model, batch, shadow=False):
    return token_logprobs(logits_of(model, batch, shadow), tokens_of(batch))  # [N, R]


def ppo_term(logp, old, adv, eps=0.2):
    """-min(r A, clip(r, 1 - eps, 1 + eps) A) per token, written out."""
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])


def token_mean(per_token, mask):
    return float((per_token * mask).sum() / mask.sum())


def kl_full_vocab(teacher_logits, student_logits):
    """KL(teacher || student) over the vocabulary, per token: sum_v p_t (log p_t - log p_s)."""
    log_t, log_s = teacher_logits.log_softmax(-1), student_logits.log_softmax(-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def expected_loss(name, model, batch, adv, lam=0.1, beta=0.0, ref_model=None, loss_agg="token_mean"):
    """The GRPO objective of `name` on `batch` before the update, from the formulas (DESIGN.md section 4)."""
    mask = batch.response_mask.float()
    dense, sampler = logp_of(model, batch), batch.logprobs
    if name == "smd":
        shadow_logits = logits_of(model, batch, shadow=True)
        shadow = token_logprobs(shadow_logits, tokens_of(batch))
        policy = token_mean(ppo_term(shadow, sampler, adv), mask)  # ratio against the sampler's own log-probs
        return policy + lam * token_mean(kl_full_vocab(logits_of(model, batch), shadow_logits), mask)
    per_token = ppo_term(dense, dense, adv)  # pi_old is the dense recompute: ratio 1 at the first update
    if name == "tis":
        per_token = per_token * torch.exp(dense - sampler).clamp(max=2.0)
    if loss_agg == "seq_mean_token_mean":
        policy = float(((per_token * mask).sum(1) / mask.sum(1)).mean())
    else:
        policy = token_mean(per_token, mask)
    if beta:
        ref = logp_of(ref_model, batch)
        policy += beta * token_mean(torch.exp(ref - dense) - (ref - dense) - 1, mask)  # k3
    return policy


@pytest.mark.parametrize(
    "name, settings",
    [
        ("dense", {}),
        ("dense", {"loss_agg": "seq_mean_token_mean"}),
        ("dense", {"beta": 0.04}),
        ("naive_sparse", {}),
        ("tis", {}),
        ("smd", {"lam": 0.3}),
        ("smd", {"lam": 0.3, "micro_batch_size": 3}),  # micro-batches add up to the full-batch loss
    ],
)
def test_each_algorithms_loss_matches_the_formula(tiny_model, tiny_tokenizer, name, settings):
    batch = rollout(tiny_model, tiny_tokenizer, None if name == "dense" else SnapKV(compression=0.5))
    ref_model = None
    if settings.get("beta"):
        ref_model = copy.deepcopy(tiny_model)
        with torch.no_grad():
            for p in ref_model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    fields = {k: v for k, v in settings.items() if k in ("lam", "beta", "loss_agg")}
    want = expected_loss(name, tiny_model, batch, ADVANTAGES, ref_model=ref_model, **fields)
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    metrics = learner_step(tiny_model, optimizer, batch, ADVANTAGES, Algorithm(name, **settings), ref_model)
    assert metrics["loss"] == pytest.approx(want, abs=1e-5)
    assert abs(want) > 1e-3  # the value compared is not trivially zero


def test_smd_first_update_ratio_is_one_under_the_shadow_mask(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5))
    assert batch.stats["kv/kept_fraction"] < 0.8  # the rollout really evicted
    shadow = logp_of(tiny_model, batch, shadow=True)
    ratio = torch.exp(shadow - batch.logprobs)[batch.response_mask]
    assert (ratio - 1).abs().max() <= 1e-5
    metrics = learner_step(tiny_model, torch.optim.AdamW(tiny_model.parameters()), batch, ADVANTAGES, Algorithm("smd"))
    assert metrics["mismatch/max_abs_diff"] <= 1e-5  # SMD's view = the sampler's
    assert metrics["mismatch/dense_max_abs_diff"] > 1e-3  # while the dense teacher sees something else


def test_naive_sparse_shows_the_mismatch(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5))
    metrics = learner_step(tiny_model, torch.optim.AdamW(tiny_model.parameters()), batch, ADVANTAGES, Algorithm("naive_sparse"))
    assert metrics["mismatch/max_abs_diff"] > 1e-3  # the dense learner vs the evicting sampler
    assert metrics["mismatch/max_abs_diff"] == pytest.approx(metrics["mismatch/dense_max_abs_diff"])


class GradientCapture:
    """An 'optimizer' that records the gradients `learner_step` hands it and changes nothing."""

    def __init__(self, params):
        self.params, self.grads = list(params), None
        self.param_groups = [{"params": self.params}]

    def step(self):
        self.grads = [p.grad.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def distill_gradients(model, batch, lam, teacher_constant: bool):
    """Parameter gradients of lam * token_mean(KL(teacher || shadow)), the teacher held constant or not."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        shadow = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)
        teacher = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length)
        if teacher_constant:
            teacher = teacher.detach()
        mask = batch.response_mask.float()
        (lam * (kl_full_vocab(teacher, shadow) * mask).sum() / mask.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_smd_teacher_is_a_constant(tiny_model, tiny_tokenizer, monkeypatch):
    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5))
    teachers = []
    hidden_of = learner._hidden

    def recording(model, batch, rows, algo, shadow):
        out = hidden_of(model, batch, rows, algo, shadow)
        if not shadow:
            teachers.append(out)
        return out

    monkeypatch.setattr(learner, "_hidden", recording)
    capture = GradientCapture(tiny_model.parameters())
    # zero advantages: the GRPO term has no gradient, so what reaches the weights is lambda * KL alone
    learner_step(tiny_model, capture, batch, torch.zeros(8), Algorithm("smd", lam=0.5, max_grad_norm=1e9))
    assert teachers and all(not t.requires_grad and t.grad_fn is None for t in teachers)
    constant = distill_gradients(tiny_model, batch, 0.5, teacher_constant=True)
    through_both = distill_gradients(tiny_model, batch, 0.5, teacher_constant=False)
    for got, want in zip(capture.grads, constant):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-4)
    # the comparison can fail: letting the gradient into the teacher changes it
    assert max(float((a - b).abs().max()) for a, b in zip(through_both, constant)) > 1e-5


def with_sampler_ratios(model, batch, rho):
    """Set the sampler's log-probs so that pi_dense_old / pi_sparse = rho exactly where it matters."""
    batch.logprobs = logp_of(model, batch) - rho.log()
    return batch


def test_sparse_rl_weights_masks_and_vetoes_through_learner_step(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer)
    assert bool(batch.response_mask.all()) and batch.response_mask.shape == (8, 5)
    rho = torch.ones(8, 5)
    rho[0, 1] = 2.0  # above 1.5: rejected (its weight would be capped at 1.5)
    rho[1, 3] = 0.3  # below 0.5: rejected
    rho[2, 0] = 5e-5  # below the veto 1e-4: sequence 2 dropped whole
    rho[3, 2], rho[4, 4] = 1.4, 0.6  # inside [0.5, 1.5]: kept, weighted
    with_sampler_ratios(tiny_model, batch, rho)
    capped = rho.clamp(max=1.5)
    weights = capped / capped.mean()
    keep = torch.ones(8, 5, dtype=torch.bool)
    keep[0, 1] = keep[1, 3] = False
    keep[2] = False
    want = float((-ADVANTAGES[:, None] * weights)[keep].sum() / keep.sum())  # ratio 1 at the first update
    metrics = learner_step(tiny_model, torch.optim.AdamW(tiny_model.parameters()), batch, ADVANTAGES, Algorithm("sparse_rl"))
    assert metrics["is/rejected_token_frac"] == pytest.approx(7 / 40)
    assert metrics["is/rejected_seq_frac"] == pytest.approx(1 / 8)
    assert metrics["is/weight_max"] == pytest.approx(1.5 / float(capped.mean()), rel=1e-5)
    assert metrics["is/weight_mean"] == pytest.approx(1.0, rel=1e-5)
    assert metrics["loss"] == pytest.approx(want, abs=1e-5)
    assert metrics["learner/skipped_empty_batch"] == 0.0


def test_empty_batch_after_rejection_is_skipped(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer)
    rho = torch.ones(8, 5)
    rho[:, 0] = 1e-5  # every sequence vetoed
    with_sampler_ratios(tiny_model, batch, rho)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    metrics = learner_step(tiny_model, optimizer, batch, ADVANTAGES, Algorithm("sparse_rl"))
    assert metrics["learner/skipped_empty_batch"] == 1.0
    assert metrics["is/rejected_seq_frac"] == 1.0 and "loss" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    assert not optimizer.state  # no optimizer step was taken


def test_non_finite_loss_or_gradient_raises_without_stepping(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    with pytest.raises(TrainingDiverged, match="non-finite loss nan"):
        learner_step(tiny_model, optimizer, batch, torch.full((8,), math.nan), Algorithm("dense"))
    handle = tiny_model.model.norm.weight.register_hook(lambda grad: grad * math.inf)
    with pytest.raises(TrainingDiverged, match="non-finite gradient norm"):
        learner_step(tiny_model, optimizer, batch, ADVANTAGES, Algorithm("dense"))
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    assert all(p.grad is None for p in tiny_model.parameters())


def test_tis_truncates_at_the_cap_through_learner_step(tiny_model, tiny_tokenizer):
    batch = rollout(tiny_model, tiny_tokenizer)
    rho = torch.ones(8, 5)
    rho[0, 0], rho[3, 1], rho[5, 2] = 3.0, 0.25, 1.7  # 3.0 is truncated to C = 2; no token is masked
    with_sampler_ratios(tiny_model, batch, rho)
    want = float((-ADVANTAGES[:, None] * rho.clamp(max=2.0)).mean())
    metrics = learner_step(tiny_model, torch.optim.AdamW(tiny_model.parameters()), batch, ADVANTAGES, Algorithm("tis"))
    assert metrics["is/truncated_token_frac"] == pytest.approx(1 / 40)
    assert metrics["is/weight_max"] == pytest.approx(2.0)
    assert metrics["loss"] == pytest.approx(want, abs=1e-5)
