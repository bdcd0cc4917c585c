"""`learner_step` against the formulas of DESIGN.md section 4, written out by hand with the same log-probs:
each algorithm's loss, SMD's ratio parity under the shadow mask, the stop-gradient on the dense teacher,
Sparse-RL's weights, masks and vetoes, the empty-batch skip, and the divergence guard. Then two iterations
(`num_iterations=2`, a large SGD step) against an eager reference that shares no code with smd_cli's scoring,
losses or attention: off-policy ratios at the second iteration, the clip with epsilon != epsilon_high,
gradient clipping, the updated weights, SMD's per-iteration dense teacher, and the reported clip fractions."""

import copy
import math

import pytest
import torch

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner import step as learner
from smd_cli.learner.forward import response_logits
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.rollout.sampler import generate
from smd_cli.rollout.sampling import token_logprobs
from smd_cli.runtime.failures import TrainingDiverged
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
    both = learner.shadow_and_teacher_hidden

    def recording(*args):
        student, teacher = both(*args)
        teachers.append(teacher)
        return student, teacher

    monkeypatch.setattr(learner, "shadow_and_teacher_hidden", recording)
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


def test_the_response_row_teacher_equals_a_full_dense_forward(tiny_model, tiny_tokenizer):
    """The teacher runs only the response rows on the replay's prompt keys and values: the same hidden
    states as a dense forward over the whole sequence (left padding and rows ended early included)."""
    from smd_cli.learner.forward import response_hidden, shadow_and_teacher_hidden

    batch = rollout(tiny_model, tiny_tokenizer, SnapKV(compression=0.5))
    args = (batch.input_ids, batch.attention_mask, batch.prompt_length)
    student, teacher = shadow_and_teacher_hidden(tiny_model, *args, batch.evict_at)
    with torch.no_grad():
        dense = response_hidden(tiny_model, *args)
        shadow = response_hidden(tiny_model, *args, batch.evict_at)
    real = batch.response_mask
    torch.testing.assert_close(teacher[real], dense[real], atol=2e-6, rtol=0)
    torch.testing.assert_close(student.detach(), shadow, atol=0, rtol=0)
    assert not teacher.requires_grad and student.requires_grad
    assert float((teacher - student.detach()).abs()[real].max()) > 1e-3  # the two views differ where eviction bites


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


# --- Two iterations against an eager reference written out here -------------------------------------------
# Everything below `learner_step` in these tests is recomputed without smd_cli's scoring, losses or attention:
# a plain-PyTorch Qwen3 forward with an explicit [N, L, Hkv, T, T] attention mask (dense: causal over real
# keys; SMD: the shadow mask decoded by DESIGN.md section 2's rule `j <= i < evict_at[b, l, h, j]`), the PPO-clip
# surrogate with epsilon / epsilon_high, token_mean aggregation, SMD's full-vocabulary KL to a stop-gradient
# dense teacher of the *current* weights, gradient-norm clipping, and plain SGD steps.


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_response_logits(params, config, input_ids, attention_mask, visible, prompt_length):
    """Qwen3's forward in plain PyTorch (softmax attention with the explicit mask `visible` [N, L, Hkv, T, T]),
    logits at the positions predicting the response: [N, R, V]. `params` are the model's named parameters
    (the head is tied to the embedding)."""
    n, width = input_ids.shape
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    groups, eps = heads // kv_heads, config.rms_norm_eps
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).float()  # real positions under left padding
    inv_freq = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [N, 1, T, D]
    cos, sin = angles.cos(), angles.sin()
    x = params["model.embed_tokens.weight"][input_ids]
    for layer in range(config.num_hidden_layers):
        w = {name[len(f"model.layers.{layer}."):]: p for name, p in params.items() if name.startswith(f"model.layers.{layer}.")}
        h = _rms(x, w["input_layernorm.weight"], eps)
        q = _rms((h @ w["self_attn.q_proj.weight"].T).view(n, width, heads, dim), w["self_attn.q_norm.weight"], eps).transpose(1, 2)
        k = _rms((h @ w["self_attn.k_proj.weight"].T).view(n, width, kv_heads, dim), w["self_attn.k_norm.weight"], eps).transpose(1, 2)
        v = (h @ w["self_attn.v_proj.weight"].T).view(n, width, kv_heads, dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # GQA: head h reads KV head h // groups
        mask = visible[:, layer].repeat_interleave(groups, dim=1)  # [N, H, T, T]
        scores = (q @ k.transpose(-1, -2)) * dim**-0.5
        attended = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [N, H, T, D]
        x = x + attended.transpose(1, 2).reshape(n, width, heads * dim) @ w["self_attn.o_proj.weight"].T
        h = _rms(x, w["post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    x = _rms(x, params["model.norm.weight"], eps)
    return x[:, prompt_length - 1 : -1] @ params["model.embed_tokens.weight"].T


def explicit_mask(batch, config, shadow: bool):
    """[N, L, Hkv, T, T] bool: query i sees key j iff j <= i, j is a real token and (shadow) i < evict_at[., ., ., j].
    Every row also sees its own key, so that padding rows and the never-fed last column stay finite (no real
    query sees those keys, so their rows change nothing else)."""
    real = batch.attention_mask.bool()
    width = real.shape[1]
    i, j = torch.arange(width)[:, None], torch.arange(width)[None, :]
    visible = (j <= i) & real[:, None, None, None, :]  # [N, 1, 1, T, T]
    if shadow:
        visible = visible & (i < batch.evict_at[:, :, :, None, :].long())
    visible = visible.expand(-1, config.num_hidden_layers, config.num_key_value_heads, width, width)
    return visible | (i == j)


def reference_iterations(params, config, batch, adv, *, name, lr, iterations, epsilon, epsilon_high, lam, max_grad_norm,
                         frozen_teacher=False):
    """`iterations` SGD steps of the algorithm `name` from `params`, by hand. Returns per-iteration records
    (loss, policy, distill, clip counts, clipped gradients, grad norm) and the final parameters.
    `frozen_teacher=True` is a deliberately wrong SMD (teacher kept at the first iteration's weights)."""
    mask = batch.response_mask.float()
    tokens = batch.input_ids[:, batch.prompt_length :]
    dense_mask = explicit_mask(batch, config, shadow=False)
    view_mask = explicit_mask(batch, config, shadow=name == "smd")

    def logits(p, visible):
        return eager_response_logits(p, config, batch.input_ids, batch.attention_mask, visible, batch.prompt_length)

    def token_logp(lgts):
        return lgts.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)

    with torch.no_grad():
        dense_old = token_logp(logits(params, dense_mask))  # pi_old of the dense learners: the weights before any step
    old = batch.logprobs if name == "smd" else dense_old
    weights = torch.exp(dense_old - batch.logprobs).clamp(max=2.0) if name == "tis" else torch.ones_like(mask)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    first_teacher = None
    records = []
    for _ in range(iterations):
        student_logits = logits(params, view_mask)
        logp = token_logp(student_logits)
        ratio = torch.exp(logp - old)
        a = adv[:, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - epsilon, 1 + epsilon_high) * a) * weights
        policy = (per_token * mask).sum() / mask.sum()
        distill = torch.zeros(())
        if name == "smd":
            with torch.no_grad():
                teacher = logits(params, dense_mask).log_softmax(-1)
            if first_teacher is None:
                first_teacher = teacher
            if frozen_teacher:
                teacher = first_teacher
            kl = (teacher.exp() * (teacher - student_logits.log_softmax(-1))).sum(-1)  # KL(teacher || student)
            distill = (kl * mask).sum() / mask.sum()
        loss = policy + lam * distill
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        scale = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        with torch.no_grad():
            valid = mask.bool()
            records.append({
                "loss": float(loss), "policy": float(policy), "distill": float(distill), "grad_norm": float(norm),
                "low": int(((ratio < 1 - epsilon) & (a < 0) & valid).sum()),
                "high": int(((ratio > 1 + epsilon_high) & (a > 0) & valid).sum()),
                "between": int(((ratio > 1 + epsilon) & (ratio <= 1 + epsilon_high) & (a > 0) & valid).sum()),
                "grads": [g * scale for g in grads],
                "teacher": teacher if name == "smd" else None,
            })
            params = {k: (p - lr * scale * g).detach().requires_grad_(True) for (k, p), g in zip(params.items(), grads)}
    return records, {k: v.detach() for k, v in params.items()}


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the (already clipped) gradients of every step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def varied_rollout(model, tokenizer, policy):
    """8 sequences (2 prompts x 4) of 5 sampled tokens, prompts cut to different lengths (left padding)."""
    task = NeedleRetrieval(prompt_tokens=32)
    prompts = [task.encode_prompt(task.example("train", i), tokenizer)[3 * g :] for i in range(2) for g in range(4)]
    return generate(model, prompts, policy=policy, max_new_tokens=5, generator=torch.Generator().manual_seed(0),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


EPS, EPS_HIGH, LAM, MAX_GRAD_NORM = 0.1, 0.3, 0.5, 1.0
# With gradients clipped to norm 1, an SGD step of 0.07 is large for this model: at the second iteration the
# ratios spread over both clip edges and the band (1 + EPS, 1 + EPS_HIGH] between them.
LR = 0.07


def run_two_iterations(model, tokenizer, name, micro_batch_size=None, monkeypatch=None):
    """The batch, the reference records and parameters, the learner's metrics, recorded gradients and teachers."""
    batch = varied_rollout(model, tokenizer, None if name == "dense" else SnapKV(compression=0.5, sink=2, window=6))
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    settings = dict(name=name, lr=LR, iterations=2, epsilon=EPS, epsilon_high=EPS_HIGH, lam=LAM, max_grad_norm=MAX_GRAD_NORM)
    want, want_params = reference_iterations(start, model.config, batch, ADVANTAGES, **settings)
    teachers = []
    if monkeypatch is not None:  # record the learner's dense forwards (SMD: the teacher of each iteration)
        both = learner.shadow_and_teacher_hidden

        def recording(model_, *args):
            student, teacher = both(model_, *args)
            with torch.no_grad():  # its log-probs over the vocabulary, through the head of the weights of this moment
                teachers.append(model_.get_output_embeddings()(teacher).float().log_softmax(-1))
            return student, teacher

        monkeypatch.setattr(learner, "shadow_and_teacher_hidden", recording)
    optimizer = RecordingSGD(model.parameters(), lr=LR)
    algo = Algorithm(name, num_iterations=2, epsilon=EPS, epsilon_high=EPS_HIGH, lam=LAM, max_grad_norm=MAX_GRAD_NORM,
                     micro_batch_size=micro_batch_size)
    got = learner_step(model, optimizer, batch, ADVANTAGES, algo)
    return batch, start, settings, want, want_params, got, optimizer.seen, teachers


@pytest.mark.parametrize("name, micro_batch_size", [("dense", None), ("tis", None), ("smd", None), ("smd", 3)])
def test_two_iterations_match_an_eager_reference(tiny_model, tiny_tokenizer, monkeypatch, name, micro_batch_size):
    batch, start, settings, want, want_params, got, seen, teachers = run_two_iterations(
        tiny_model, tiny_tokenizer, name, micro_batch_size, monkeypatch)
    assert batch.attention_mask[:, : batch.prompt_length].eq(0).any()  # some rows are left-padded
    # the second iteration is off-policy: both clip edges and the band between epsilon and epsilon_high are hit
    second = want[1]
    assert second["low"] >= 5 and second["high"] >= 1 and second["between"] >= 5, second
    assert want[0]["low"] == want[0]["high"] == 0  # the first iteration's ratio is 1 (SMD: shadow = sampler)
    assert want[0]["grad_norm"] > MAX_GRAD_NORM  # the first step's gradient is clipped

    mean = lambda key: sum(r[key] for r in want) / len(want)  # reported losses: the mean over the iterations
    assert got["loss"] == pytest.approx(mean("loss"), abs=1e-5)
    assert got["loss/policy"] == pytest.approx(mean("policy"), abs=1e-5)
    assert got["loss/distill"] == pytest.approx(mean("distill"), abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want[-1]["grad_norm"], rel=1e-4)  # the last iteration's, before clipping
    assert len(seen) == 2  # one optimizer step per iteration, each with the clipped gradient of the reference
    for iteration, (grads, record) in enumerate(zip(seen, want)):
        for g, w in zip(grads, record["grads"]):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-3, msg=lambda m: f"iteration {iteration}: {m}")
    for k, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.detach(), want_params[k], atol=1e-6, rtol=1e-4)

    # the comparison can fail: the same reference with epsilon_high = epsilon gives another loss
    ignored, _ = reference_iterations(start, tiny_model.config, batch, ADVANTAGES, **{**settings, "epsilon_high": EPS})
    assert abs(sum(r["loss"] for r in ignored) / 2 - got["loss"]) > 5e-3
    if name == "smd":
        # SMD's teacher is the dense forward of the current weights at every iteration, held constant
        assert len(teachers) == 2 * (1 if micro_batch_size is None else math.ceil(8 / micro_batch_size))
        per_iteration = len(teachers) // 2
        for iteration in range(2):
            teacher = torch.cat(teachers[iteration * per_iteration : (iteration + 1) * per_iteration])  # [N, R, V]
            torch.testing.assert_close(teacher, want[iteration]["teacher"], atol=2e-5, rtol=1e-4)
        frozen, _ = reference_iterations(start, tiny_model.config, batch, ADVANTAGES, **settings, frozen_teacher=True)
        assert abs(frozen[1]["distill"] - want[1]["distill"]) > 2e-4  # a teacher kept from iteration 1 is visibly off
        assert float((want[1]["teacher"] - want[0]["teacher"]).abs().max()) > 1e-2  # the teacher did move


@pytest.mark.parametrize("name", ["dense", "smd"])
def test_clip_fractions_count_every_iteration(tiny_model, tiny_tokenizer, name):
    """`clip_ratio/*_mean` are the fractions of kept tokens where the low / high clip is active, averaged over
    the `num_iterations` passes (TRL logs them at every pass). At the first pass the ratio is 1 by
    construction for every algorithm, so counting that pass alone always reports 0."""
    batch, _, _, want, _, got, _, _ = run_two_iterations(tiny_model, tiny_tokenizer, name)
    tokens = int(batch.response_mask.sum())  # every token is kept (no Sparse-RL rejection here)
    low = sum(r["low"] for r in want) / (2 * tokens)
    high = sum(r["high"] for r in want) / (2 * tokens)
    assert low > 0.05 and high > 0.01
    assert got["clip_ratio/low_mean"] == pytest.approx(low, abs=1e-9)
    assert got["clip_ratio/high_mean"] == pytest.approx(high, abs=1e-9)
    assert got["clip_ratio/region_mean"] == pytest.approx(low + high, abs=1e-9)
