"""The evicting rollout against its three learners (DESIGN.md section 3, contracts 1, 2 and 4).

For every policy, on CPU float32, with GQA (4 heads, 2 KV heads), left padding (prompts of 24 to 48
tokens), a batch of 4 and sampling at temperature 1: the shadow replay and the physical learner give the
sampler's log-probs to 1e-5; the dense learner is visibly off under compression 0.5 and exact under none;
the recorded visibility equals the decoded encoding; KV bytes follow the budget, (k + g) / (P + R - 1).
"""

import pytest
import torch

from smd_cli.attention.shadow import decode_visibility
from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.knorm import KNorm
from smd_cli.eviction.none import KeepAll
from smd_cli.eviction.random import RandomEviction
from smd_cli.eviction.recent import Recent
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_logits
from smd_cli.learner.physical import physical_response_logits
from smd_cli.model.build import build_tiny_model
from smd_cli.rollout.sampler import generate
from smd_cli.rollout.sampling import token_logprobs

BOUND = 1e-5
R = 10
POLICIES = {
    "none": lambda: KeepAll(),
    "snapkv": lambda: SnapKV(compression=0.5, sink=2, window=6, kernel=3),
    "recent": lambda: Recent(compression=0.5, sink=2, window=6),
    "random": lambda: RandomEviction(compression=0.5, sink=2, window=6, seed=1),
    "knorm": lambda: KNorm(compression=0.5, sink=2, window=6),
    "h2o": lambda: H2O(compression=0.5, sink=0, window=4),
    "snapkv_recompress": lambda: SnapKV(compression=0.5, sink=2, window=3, kernel=3, recompress_every=4),
}


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_tiny_model(len(tiny_tokenizer), seed=0).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (24, 33, 41, 48)]


@pytest.fixture(scope="module")
def rollouts(model, prompts):
    """One rollout per policy (temperature 1, seeded), with the visibility log."""
    return {
        name: generate(
            model, prompts, policy=make(), max_new_tokens=R, temperature=1.0,
            generator=torch.Generator().manual_seed(7), eos_token_id=2, pad_token_id=0, record_visibility=True,
        )
        for name, make in POLICIES.items()
    }


def diff(batch, logits, temperature=1.0):
    logp = token_logprobs(logits, batch.input_ids[:, batch.prompt_length:], temperature, batch.sampling_support)  # top-p: its kept set
    return (logp - batch.logprobs)[batch.response_mask].abs()


@pytest.mark.parametrize("name", list(POLICIES))
def test_shadow_replay_gives_the_sampler_logprobs(model, rollouts, name):
    batch = rollouts[name]
    assert batch.input_ids.shape == (4, 48 + R) and batch.response_mask.all()
    with torch.no_grad():
        shadow = diff(batch, response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at))
        dense = diff(batch, response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length))
    assert shadow.max() <= BOUND, f"{name}: shadow replay off by {shadow.max():.2e}"
    if name == "none":
        assert dense.max() <= BOUND
        assert (batch.evict_at[batch.attention_mask.bool()[:, None, None].expand_as(batch.evict_at)] == batch.input_ids.shape[1]).all()
    else:
        assert dense.max() > 1e-3, f"{name}: the dense learner should see the mismatch, got {dense.max():.2e}"


@pytest.mark.parametrize("name", list(POLICIES))
def test_physical_learner_agrees(model, rollouts, name):
    batch = rollouts[name]
    with torch.no_grad():
        physical = diff(batch, physical_response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at))
    assert physical.max() <= BOUND, f"{name}: physical learner off by {physical.max():.2e}"


@pytest.mark.parametrize("name", list(POLICIES))
def test_encoding_reproduces_recorded_visibility(rollouts, name):
    batch = rollouts[name]
    decoded = decode_visibility(batch.evict_at)  # [N, L, Hkv, T, T]
    width = batch.input_ids.shape[1]
    rows = batch.attention_mask.bool().clone()  # queries the rollout ran: real ones and the prompt padding
    rows[:, : batch.prompt_length] = True
    rows[:, width - 1] = False  # the last sampled token is never fed
    rows = rows[:, None, None, :].expand(decoded.shape[:4])
    assert torch.equal(decoded[rows], batch.visibility[rows])
    if name != "none":
        assert not decoded[rows].all(dim=-1).any()  # something is hidden somewhere


def test_h2o_evicts_while_decoding(rollouts):
    evict_at, prompt_width = rollouts["h2o"].evict_at, rollouts["h2o"].prompt_length
    width = evict_at.shape[-1]
    during = (evict_at > prompt_width) & (evict_at < width)
    assert during.any(), "H2O recorded no decode-time eviction"
    assert (during[..., prompt_width:]).any(), "no generated token was ever evicted"
    assert not torch.equal(evict_at[:, 0], evict_at[:, 1]), "layers should decide independently"
    assert not torch.equal(evict_at[:, :, 0], evict_at[:, :, 1]), "KV heads should decide independently"


def test_snapkv_recompresses_every_n_steps(rollouts):
    batch = rollouts["snapkv_recompress"]
    prompt_width = batch.prompt_length
    times = batch.evict_at[(batch.evict_at > prompt_width) & (batch.evict_at < batch.input_ids.shape[1])].unique()
    assert times.tolist() == [prompt_width + 4, prompt_width + 8]  # after decode steps 3 and 7


# KV bytes, from the definitions (DESIGN.md sections 2 and 3.4). What `kv/bytes_peak` counts is the storage of the
# cache's keys and values: an evicting cache allocates each layer once, right after prefill, as [N, Hkv, S, D]
# slots with S = k + g, where
# - k = the prompt budget of the widest row, clamp(ceil((1 - c) * P), min = sink + window, max = P) (sink and window
#   are inside the budget, not on top of it; KeepAll keeps all P),
# - g = the slots for generated tokens: the R - 1 fed tokens (the last sampled token is never fed, so its KV is
#   never stored) for prefill-time policies; 1 for H2O, which writes the new token into one spare slot and evicts
#   back to the budget every step; N for SnapKV re-compressing every N steps (min(N, R - 1)).
# `kv/bytes_peak_dense` is a DynamicCache fed the same P + R - 1 columns, padding columns included (P is the padded
# prompt width, the widest prompt). Every slot holds the same L * 2 (K and V) * N * Hkv * D float32 numbers, so
#     bytes / dense bytes = (k + g) / (P + R - 1),  i.e. (k + R - 1) / (P + R - 1) for prefill-time eviction.
def slot_bytes(model, rows):
    """Bytes of one cache column over the whole batch: L layers x (K, V) x rows x Hkv x D x 4 (float32)."""
    config = model.config
    return config.num_hidden_layers * 2 * rows * config.num_key_value_heads * config.head_dim * 4


# the fixture's rollouts: c = 0.5, P = 48 (the widest prompt), R = 10, so P + R - 1 = 57 columns; k = ceil(24) = 24
KV_SLOTS = {"none": 48 + 9, "snapkv": 24 + 9, "recent": 24 + 9, "random": 24 + 9, "knorm": 24 + 9, "h2o": 24 + 1,
            "snapkv_recompress": 24 + 4}


@pytest.mark.parametrize("name", list(POLICIES))
def test_kv_bytes_follow_the_budget(model, rollouts, name):
    stats = rollouts[name].stats
    assert stats["rollout/steps"] == R
    dense_columns = 48 + R - 1
    assert stats["kv/bytes_peak_dense"] == pytest.approx(dense_columns * slot_bytes(model, 4), rel=0.03)
    assert stats["kv/bytes_peak"] == pytest.approx(KV_SLOTS[name] * slot_bytes(model, 4), rel=0.03)
    ratio = stats["kv/bytes_peak"] / stats["kv/bytes_peak_dense"]
    assert ratio == pytest.approx(KV_SLOTS[name] / dense_columns, rel=0.03), (name, ratio)


@pytest.mark.parametrize(
    "policy, compression, kept, growth",
    [
        # prefill-time (SnapKV, sink 2 + window 6 = 8): g = R - 1 = 9
        ("snapkv", 0.2, 39, 9),  # ceil(0.8 * 48 = 38.4) = 39
        ("snapkv", 0.6, 20, 9),  # ceil(19.2) = 20
        ("snapkv", 0.9, 8, 9),  # ceil(4.8) = 5, raised to sink + window = 8
        # decode-time (H2O, sink 0 + window 4): g = 1
        ("h2o", 0.2, 39, 1),
        ("h2o", 0.6, 20, 1),
        ("h2o", 0.9, 5, 1),  # ceil(4.8) = 5 > sink + window
    ],
)
def test_kv_bytes_at_several_compressions(model, prompts, policy, compression, kept, growth):
    make = {"snapkv": lambda c: SnapKV(compression=c, sink=2, window=6, kernel=3), "h2o": lambda c: H2O(compression=c, sink=0, window=4)}
    batch = generate(model, prompts, policy=make[policy](compression), max_new_tokens=R, generator=torch.Generator().manual_seed(7),
                     eos_token_id=-1, pad_token_id=0)  # no eos: every row runs all R steps
    stats, P = batch.stats, max(len(p) for p in prompts)
    assert P == batch.prompt_length == 48 and stats["rollout/steps"] == R
    want = (kept + growth) / (P + R - 1)
    ratio = stats["kv/bytes_peak"] / stats["kv/bytes_peak_dense"]
    assert ratio == pytest.approx(want, rel=0.03), (policy, compression, ratio, want)
    assert stats["kv/bytes_peak"] == pytest.approx((kept + growth) * slot_bytes(model, len(prompts)), rel=0.03)


def test_dense_rollout_has_no_mask_and_matches_the_dense_learner(model, prompts):
    batch = generate(model, prompts, max_new_tokens=6, generator=torch.Generator().manual_seed(3), eos_token_id=2, pad_token_id=0)
    assert batch.evict_at is None
    assert batch.stats["kv/bytes_peak"] == batch.stats["kv/bytes_peak_dense"] > 0
    with torch.no_grad():
        dense = diff(batch, response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length))
    assert dense.max() <= BOUND


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.7, 0.8)])
def test_greedy_and_top_p_keep_parity(model, prompts, temperature, top_p):
    batch = generate(
        model, prompts, policy=SnapKV(compression=0.5, sink=2, window=6), max_new_tokens=6, temperature=temperature,
        top_p=top_p, generator=torch.Generator().manual_seed(5), eos_token_id=2, pad_token_id=0,
    )
    with torch.no_grad():
        logits = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)
    assert diff(batch, logits, temperature).max() <= BOUND
    if temperature == 0:
        assert torch.equal(logits.argmax(-1), batch.input_ids[:, batch.prompt_length:])


def test_rows_stop_at_eos_and_parity_holds(model, prompts):
    """Make the first greedy token of row 0 the eos: row 0 stops at once, the others go on."""
    probe = generate(model, prompts, policy=H2O(0.5, 0, 4), max_new_tokens=1, temperature=0, eos_token_id=-1, pad_token_id=0)
    eos = int(probe.input_ids[0, -1])
    batch = generate(model, prompts, policy=H2O(0.5, 0, 4), max_new_tokens=8, temperature=0, eos_token_id=eos, pad_token_id=0)
    assert batch.response_mask[0].tolist() == [True] + [False] * (batch.response_mask.shape[1] - 1)
    assert (batch.input_ids[0, batch.prompt_length + 1:] == 0).all() and batch.logprobs[0, 1:].eq(0).all()
    assert batch.response_mask.sum() > 1
    with torch.no_grad():
        shadow = diff(batch, response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at))
        physical = diff(batch, physical_response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at))
    assert shadow.max() <= BOUND and physical.max() <= BOUND


def test_physical_learner_backward_matches_the_replay(model, rollouts):
    batch = rollouts["h2o"]
    grads = []
    for learner in (response_logits, physical_response_logits):
        model.zero_grad()
        logits = learner(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)
        token_logprobs(logits, batch.input_ids[:, batch.prompt_length:])[batch.response_mask].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    assert grads[0].abs().max() > 1e-3
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_bad_arguments_are_named(model, prompts):
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompts, max_new_tokens=2, top_p=0.0, eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompts, max_new_tokens=2, temperature=-1.0, eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [[]], max_new_tokens=2, eos_token_id=2, pad_token_id=0)


def test_progress_bar_runs(model, prompts, capsys):
    batch = generate(model, prompts[:1], policy=KNorm(0.5, 2, 6), max_new_tokens=3, progress=True, eos_token_id=2, pad_token_id=0,
                     generator=torch.Generator().manual_seed(0))
    assert batch.logprobs.shape == (1, 3)


@pytest.mark.parametrize("name, top_p", [("snapkv", 1.0), ("h2o", 0.8)])
def test_rollouts_generated_in_chunks_concatenate_with_parity(model, prompts, name, top_p):
    """Chunks of different prompt widths and response lengths, re-padded: the replay still matches (over the kept
    sets under top-p, each chunk's moved past the ones before)."""
    from smd_cli.rollout.sampler import concat_rollouts

    chunks = [
        generate(model, part, policy=POLICIES[name](), max_new_tokens=n, temperature=1.0, top_p=top_p,
                 generator=torch.Generator().manual_seed(3), eos_token_id=2, pad_token_id=0)
        for part, n in ((prompts[:2], 6), (prompts[2:], R))
    ]
    batch = concat_rollouts(list(chunks), pad_token_id=0)  # it consumes the list it is given
    assert batch.prompt_length == max(c.prompt_length for c in chunks) and batch.logprobs.shape[1] == R
    assert batch.input_ids.shape[0] == len(prompts) and int(batch.evict_at.max()) == batch.input_ids.shape[1]
    replay = response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)
    assert diff(batch, replay).max() <= BOUND
    assert batch.stats["kv/bytes_peak"] == max(c.stats["kv/bytes_peak"] for c in chunks)
    if top_p < 1:
        count = batch.sampling_support.count
        assert (count[batch.response_mask] > 0).all() and (count[~batch.response_mask] == 0).all()
        assert batch.sampling_support.ids.numel() == sum(c.sampling_support.ids.numel() for c in chunks)


# The decode loop reads the device only every `sync_every` steps (SYNC_EVERY on an accelerator, 1 on the CPU): between
# two looks, rows that have finished keep decoding padding. Nothing returned may show it: same tokens, log-probs, masks,
# shadow masks, visibility log and statistics, and the generator left where a loop stopping at once leaves it.
SMALL_VOCAB = 7  # eos = 2 is drawn about once in 7 tokens: rows finish at different steps, well before R_LONG
R_LONG = 40


@pytest.fixture(scope="module")
def small_vocab_model():
    return build_tiny_model(SMALL_VOCAB, seed=0).eval()


def kept_sets(batch):
    """[N, R, V] bool: each token's recorded kept set (the packing order of `Support.ids` follows the host reads), or None."""
    support = batch.sampling_support
    if support is None:
        return None
    vocab, tokens = SMALL_VOCAB, batch.input_ids[:, batch.prompt_length:]
    slots = torch.arange(support.width)
    ids = support.ids[(support.start[..., None] + slots).clamp(max=max(support.ids.numel() - 1, 0))].long()  # [N, R, width]
    sets = torch.zeros(*tokens.shape, vocab + 1, dtype=torch.bool)
    sets.scatter_(-1, torch.where(slots < support.count[..., None], ids, vocab), True)
    return sets[..., :vocab]


def _returned(batch, generator):
    fields = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "response_mask": batch.response_mask,
              "logprobs": batch.logprobs, "evict_at": batch.evict_at, "visibility": batch.visibility,
              "sampling_support": kept_sets(batch), "generator_after": torch.rand(8, generator=generator)}
    stats = {k: v for k, v in batch.stats.items() if k != "rollout/seconds"}
    return fields, stats


@pytest.mark.parametrize("name", ["dense", *POLICIES])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_periodic_host_checks_change_nothing_returned(small_vocab_model, name, temperature, top_p):
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SMALL_VOCAB, (n,), generator=generator).tolist() for n in (24, 33, 41, 48, 30, 20)]
    forwards = []
    hook = small_vocab_model.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    runs = {}
    try:
        for every in (1, 5, 16):
            forwards.clear()
            generator = torch.Generator().manual_seed(7)
            batch = generate(small_vocab_model, prompts, policy=None if name == "dense" else POLICIES[name](), max_new_tokens=R_LONG,
                             temperature=temperature, top_p=top_p, generator=generator, eos_token_id=2, pad_token_id=0,
                             record_visibility=name != "dense", sync_every=every)
            runs[every] = (*_returned(batch, generator), len(forwards))
    finally:
        hook.remove()
    fields, stats, forwards_every_step = runs[1]
    assert stats["rollout/steps"] < R_LONG and not batch.response_mask.all()  # every row stopped early, not all at once
    for every in (5, 16):
        other, other_stats, forwards_run = runs[every]
        for key, value in fields.items():
            assert (value is None and other[key] is None) or torch.equal(value, other[key]), (every, key)
        assert other_stats == stats, every
        assert forwards_run >= forwards_every_step
    assert max(runs[5][2], runs[16][2]) > forwards_every_step  # the periodic loop did decode past the last live step


def test_draw_inverts_the_cdf_by_hand():
    """`draw` picks the smallest k with u * sum(p) < p_0 + ... + p_k: checked against a loop over the tokens,
    zero-probability tokens (as top-p leaves them) never drawn, u close to 1 included."""
    from smd_cli.rollout.sampler import draw

    for trial in range(20):
        generator = torch.Generator().manual_seed(trial)
        probs = torch.softmax(torch.randn(6, 30 + trial, generator=generator) * 3, dim=-1)
        probs[:, : trial] = 0.0
        probs[:, -1] = 0.0
        uniforms = torch.cat([torch.rand(4, generator=generator), torch.tensor([0.0, 1.0 - 2.0**-24])])
        expected = []
        for p, u in zip(probs.double().tolist(), uniforms.double().tolist()):
            target, running = u * sum(p), 0.0
            k = next(i for i, q in enumerate(p) if (running := running + q) > target and q > 0)
            expected.append(k)
        got = draw(probs, uniforms)
        assert got.tolist() == expected, trial
        assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_draw_frequencies_match_the_probabilities():
    """Over 200,000 uniforms, each token is drawn with its probability (within 4 standard errors)."""
    from smd_cli.rollout.sampler import draw

    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 200_000
    tokens = draw(probs.expand(n, -1), torch.rand(n, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(tokens, minlength=5).double() / n
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert freq[1] == 0 and bool(((freq - probs.double()).abs() <= 4 * se + 1e-12).all()), freq


def test_draw_gives_each_token_its_probability_at_the_papers_vocabulary():
    """At V = 151936 every token of probability above 1e-5 is drawn with its probability to 1e-6 (relative), measured
    on `draw` itself: the uniforms that draw token k form an interval, whose ends are found by bisection. With the
    CDF summed in float32 they were off by up to 0.6 %; and the rollout's uniforms resolve finer than float32's
    2^-24 grid, which alone is 0.6 % of a probability of 1e-5."""
    from smd_cli.rollout.sampler import draw, sampling_noise

    vocab = 151936
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 2.5, dim=-1)  # float32, as sampled
    tokens = (probs > 1e-5).nonzero().squeeze(-1)
    tokens = tokens[torch.linspace(0, len(tokens) - 1, 12).long()]  # 12 tokens spread over the vocabulary
    ends = torch.cat([tokens, tokens + 1])  # [2M]: interval of token k = [first u drawing >= k, first u drawing >= k + 1)
    low, high = torch.zeros(len(ends), dtype=torch.float64), torch.ones(len(ends), dtype=torch.float64)
    for _ in range(40):  # bisection on u (to 1e-12): draw is non-decreasing in u
        middle = (low + high) / 2
        reached = draw(probs.expand(len(ends), -1), middle) >= ends
        high, low = torch.where(reached, middle, high), torch.where(reached, low, middle)
    effective = high[len(tokens):] - high[: len(tokens)]  # [M] measure of the uniforms that draw each token
    exact = probs.double()[tokens] / probs.double().sum()
    relative = ((effective - exact) / exact).abs()
    assert float(exact.min()) > 1e-5 and float(relative.max()) <= 1e-6, float(relative.max())
    noise = sampling_noise(64, 32, torch.Generator().manual_seed(0))
    assert float(((noise * 2**24).frac() != 0).double().mean()) > 0.99  # not on float32's grid


def test_rows_sample_the_same_whatever_rows_beside_them(model, prompts):
    """A row's draws come from its own row of `noise`: the rows decoded in two chunks, each with its rows of one
    noise tensor, give the tokens of one batch (the property data-parallel rollouts rely on)."""
    from smd_cli.rollout.sampler import sampling_noise

    noise = sampling_noise(len(prompts), 6, torch.Generator().manual_seed(4))
    kwargs = dict(policy=SnapKV(0.5, sink=2, window=6), max_new_tokens=6, eos_token_id=-1, pad_token_id=0, temperature=1.0)
    whole = generate(model, prompts, noise=noise, **kwargs)
    halves = [generate(model, prompts[i : i + 2], noise=noise[i : i + 2], **kwargs) for i in (0, 2)]
    P = whole.prompt_length
    for i, half in zip((0, 2), halves):
        assert torch.equal(half.input_ids[:, half.prompt_length :], whole.input_ids[i : i + 2, P:])
    with pytest.raises(ValueError, match="noise has shape"):
        generate(model, prompts, noise=noise[:2], **kwargs)


class _TooSmall(SnapKV):
    def cache_growth(self, decode_steps: int) -> int:
        return 0  # no slot for generated tokens: the first decode write finds the cache full


@pytest.mark.parametrize("every", [1, 16])
def test_a_full_cache_is_reported_at_the_check(model, prompts, every):
    with pytest.raises(RuntimeError, match="is full"):
        generate(model, prompts, policy=_TooSmall(0.5, sink=2, window=6), max_new_tokens=6, eos_token_id=-1, pad_token_id=0,
                 generator=torch.Generator().manual_seed(0), sync_every=every)


@pytest.mark.parametrize("every", [1, 16])
def test_non_finite_logits_are_reported_when_sampling(model, prompts, every):
    import copy

    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.lm_head.weight[5] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        generate(broken, prompts, policy=KNorm(0.5, 2, 6), max_new_tokens=4, eos_token_id=-1, pad_token_id=0,
                 generator=torch.Generator().manual_seed(0), sync_every=every)


def test_compile_option(model, prompts):
    """`compile` captures CUDA graphs on CUDA only: on the CPU, true warns and decodes eagerly (the same rollout)."""
    kwargs = dict(policy=SnapKV(0.5, sink=2, window=6), max_new_tokens=4, eos_token_id=2, pad_token_id=0)
    eager = generate(model, prompts, compile=False, generator=torch.Generator().manual_seed(0), **kwargs)
    with pytest.warns(RuntimeWarning, match="CUDA graphs need a CUDA device"):
        asked = generate(model, prompts, compile=True, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(eager.input_ids, asked.input_ids) and torch.equal(eager.logprobs, asked.logprobs)
    with pytest.raises(ValueError, match="compile"):
        generate(model, prompts, compile="yes", **kwargs)
    with pytest.raises(ValueError, match="sync_every"):
        generate(model, prompts, sync_every=0, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", ["snapkv", "h2o", "snapkv_recompress"])
def test_cuda_graph_decode_matches_eager(tiny_tokenizer, name):
    import warnings

    device = torch.device("cuda")
    model = build_tiny_model(len(tiny_tokenizer), seed=0, device=device).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (24, 33, 41, 48)]
    runs = {}
    for compile in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns: fail instead
            runs[compile] = generate(model, prompts, policy=POLICIES[name](), max_new_tokens=R, temperature=1.0, compile=compile,
                                     generator=torch.Generator(device=device).manual_seed(7), eos_token_id=2, pad_token_id=0)
    eager, graphed = runs[False], runs[True]
    assert torch.equal(eager.input_ids, graphed.input_ids) and torch.equal(eager.evict_at, graphed.evict_at)
    assert (eager.logprobs - graphed.logprobs).abs().max() <= 1e-5
    with torch.no_grad():
        replay = response_logits(model, graphed.input_ids, graphed.attention_mask, graphed.prompt_length, graphed.evict_at)
    assert diff(graphed, replay).max() <= 1e-4


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_repeated_prompt_is_prefilled_once_and_changes_nothing(model, prompts, monkeypatch, name):
    """GRPO's G samples of a prompt: its prefill runs once (the policy still scores every row, so a random one draws
    per row) and the rollout equals one that prefills every row; the learner computes each prompt once too, and
    both its replay and the physical learner give the sampler's log-probs."""
    from smd_cli.rollout import sampler as module

    repeated = [p for p in prompts[:3] for _ in range(3)]  # 3 prompts x 3 samples, left-padded to 41

    def run(share: bool):
        rows = []
        hook = model.model.layers[0].register_forward_pre_hook(
            lambda layer, args, kwargs: rows.append((args[0] if args else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
        if not share:
            monkeypatch.setattr(module, "prompt_groups", lambda *a: None)
        try:
            batch = generate(model, repeated, policy=POLICIES[name](), max_new_tokens=R, temperature=1.0,
                             generator=torch.Generator().manual_seed(7), eos_token_id=2, pad_token_id=0, record_visibility=True)
        finally:
            hook.remove()
            monkeypatch.undo()
        return batch, rows

    shared, rows = run(True)
    alone, rows_alone = run(False)
    assert rows[0] == 3 and rows_alone[0] == 9 and rows[1:] == rows_alone[1:] == [9] * (len(rows) - 1)  # prefill, then decode
    assert torch.equal(shared.input_ids, alone.input_ids) and torch.equal(shared.evict_at, alone.evict_at)
    assert (shared.logprobs - alone.logprobs).abs().max() <= 1e-6 and shared.stats["kv/bytes_peak"] == alone.stats["kv/bytes_peak"]
    queried = shared.attention_mask.bool().clone()  # the queries the rollout ran (as in the encoding test above)
    queried[:, : shared.prompt_length], queried[:, -1] = True, False
    queried = queried[:, None, None, :].expand(shared.visibility.shape[:4])
    assert torch.equal(decode_visibility(shared.evict_at)[queried], shared.visibility[queried])
    assert diff(shared, response_logits(model, shared.input_ids, shared.attention_mask, shared.prompt_length, shared.evict_at)).max() <= BOUND
    physical = physical_response_logits(model, shared.input_ids, shared.attention_mask, shared.prompt_length, shared.evict_at)
    assert diff(shared, physical).max() <= BOUND


def test_smd_rollout_saves_the_kept_sets_that_its_views_score(tmp_path):
    """`smd rollout sampling.top_k=5 sampling.top_p=0.99999994`: top_p within rounding of 1 keeps each token's top 5,
    never more (the float32 cumulative sum over the zeroed tail once took in the whole vocabulary); the kept sets are
    saved beside the shadow mask (`sampling_support_{ids,start,count}`), each holding its drawn token, and the
    report's shadow and physical views, scored over them, give the sampler's log-probs."""
    import json

    from safetensors.torch import load_file

    from tests.conftest import smd

    run = tmp_path / "run"
    code = smd("rollout", "model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=2", "num_generations=2", "progress=false",
               "device=cpu", "sampling.max_new_tokens=6", "sampling.top_k=5", "sampling.top_p=0.99999994", "eviction=snapkv",
               f"hydra.run.dir={run}", f"cache_dir={tmp_path / 'cache'}")
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity/max_abs_diff_shadow"] <= BOUND and summary["parity/max_abs_diff_physical"] <= BOUND
    assert summary["rollout/support_size_mean"] == 5.0 and summary["rollout/support_capped_fraction"] == 0.0
    saved = load_file(run / "shadow_masks.safetensors")
    mask, count = saved["response_mask"], saved["sampling_support_count"]
    start, ids = saved["sampling_support_start"], saved["sampling_support_ids"]
    tokens = saved["input_ids"][:, -mask.shape[1]:]
    assert (count[mask] == 5).all() and (count[~mask] == 0).all() and ids.numel() == 5 * int(mask.sum())
    for (n, r) in mask.nonzero().tolist():
        kept = ids[start[n, r] : start[n, r] + 5].tolist()
        assert len(set(kept)) == 5 and tokens[n, r].item() in kept


def test_the_cache_goes_by_the_keyword_the_models_forward_takes():
    """transformers renamed `past_key_values` to `cache` (5.2x); 5.17 (a GPU image's) ignores `cache=` and decodes every
    step without its cache. The keyword is read from the model class's own signature."""
    from smd_cli.attention.dispatch import cache_argument

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return cache

    assert cache_argument(Old(), "kv") == {"past_key_values": "kv"}
    assert cache_argument(New(), "kv") == {"cache": "kv"}
