"""Eviction policies: budgets, protected entries, selection, the decode-time rule, and their YAML files."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from smd_cli.attention.policy import EvictionPolicy, PrefillView
from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.knorm import KNorm
from smd_cli.eviction.snapkv import SnapKV

CONF = Path(__file__).resolve().parents[1] / "conf" / "eviction"


class Scored(EvictionPolicy):
    """A test policy whose scores are given."""

    def __init__(self, scores, **kwargs):
        super().__init__(**kwargs)
        self.scores = scores

    def prefill_scores(self, view):
        return self.scores


def view_of(key_real, kv_heads=2, head_dim=4, heads=4, key=None):
    batch, width = key_real.shape
    key = torch.randn(batch, kv_heads, width, head_dim) if key is None else key
    query = torch.randn(batch, heads, width, head_dim)
    return PrefillView(query=query, key=key, key_real=key_real, scaling=head_dim**-0.5, layer_idx=0)


def eager_attention(view):
    """Reference prefill probabilities [B, H, P, P]: K repeated per query head, an explicit causal mask with
    padding keys hidden and padding queries seeing themselves."""
    width = view.key.shape[2]
    columns = torch.arange(width)
    mask = ((columns[None] <= columns[:, None]) & view.key_real[:, None, None, :]) | torch.eye(width, dtype=torch.bool)
    key = view.key.repeat_interleave(view.query.shape[1] // view.key.shape[1], dim=1)
    scores = (view.query @ key.transpose(-1, -2)) * view.scaling
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def test_prefill_attention_matches_an_eager_reference_with_padding():
    key_real = torch.ones(2, 9, dtype=torch.bool)
    key_real[1, :4] = False  # left padding
    view = view_of(key_real)
    reference = eager_attention(view)
    torch.testing.assert_close(view.attention(0), reference)
    torch.testing.assert_close(view.attention(5, 8), reference[:, :, 5:8])
    torch.testing.assert_close(view.attention_received(chunk=2), reference.sum(dim=2))  # H2O's column sums, in chunks


def test_budget_follows_the_design_formula():
    policy = EvictionPolicy(compression=0.5, sink=4, window=16)
    # ceil(0.5 * P), at least sink + window = 20, at most P
    assert policy.budget(torch.tensor([10, 40, 41, 64])).tolist() == [10, 20, 21, 32]
    assert EvictionPolicy(compression=0.9, sink=4, window=16).budget(torch.tensor([64])).tolist() == [20]
    assert EvictionPolicy(compression=0.0, sink=0, window=0).budget(torch.tensor([7])).tolist() == [7]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: EvictionPolicy(compression=1.0), "compression"),
        (lambda: EvictionPolicy(compression=-0.1), "compression"),
        (lambda: EvictionPolicy(sink=-1), "sink"),
        (lambda: SnapKV(kernel=4), "kernel"),
        (lambda: H2O(chunk=0), "chunk"),
    ],
)
def test_bad_options_are_rejected_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_protected_entries_follow_left_padding():
    key_real = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    protected = EvictionPolicy(compression=0.5, sink=1, window=2).protected_prompt(key_real)
    assert protected.int().tolist() == [[0, 0, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 1, 1]]


def test_selection_keeps_protected_then_top_scores_per_row_and_head():
    key_real = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    scores = torch.zeros(2, 2, 8)
    scores[:, 0, 3] = 5.0  # head 0 likes column 3, head 1 likes column 4
    scores[:, 1, 4] = 5.0
    scores[1, :, 2] = 9.0  # row 1: column 2 beats everything in both heads
    policy = Scored(scores, compression=0.5, sink=1, window=1)
    chosen = policy.select_prefill(view_of(key_real), policy.budget(key_real.sum(-1)))  # budgets 3 and 4
    kept = [[chosen.index[b, h][chosen.ok[b, h]].tolist() for h in range(2)] for b in range(2)]
    assert kept == [[[2, 3, 7], [2, 4, 7]], [[0, 2, 3, 7], [0, 2, 4, 7]]]
    assert chosen.ok.sum(-1).tolist() == [[3, 3], [4, 4]]


def test_knorm_keeps_the_smallest_keys():
    key_real = torch.ones(1, 8, dtype=torch.bool)
    key = torch.ones(1, 1, 8, 4)
    key[0, 0, [1, 5]] = 0.01  # two tiny keys in the middle
    policy = KNorm(compression=0.5, sink=1, window=1)
    chosen = policy.select_prefill(view_of(key_real, kv_heads=1, heads=2, key=key), torch.tensor([4]))
    assert chosen.index[0, 0].tolist() == [0, 1, 5, 7]


def test_h2o_evicts_the_lowest_unprotected_entry_only_over_budget():
    policy = H2O(compression=0.5, sink=1, window=2)
    columns = torch.tensor([[[0, 3, 5, 6, 9, -1]]], dtype=torch.int32)  # slots of one (row, KV head)
    scores = torch.tensor([[[0.1, 0.9, 0.2, 0.5, 0.0, 0.0]]])
    evict = policy.select_decode(scores, columns, torch.tensor([4]), column=9, first_real=torch.tensor([0]))
    assert evict.int().tolist() == [[[0, 0, 1, 0, 0, 0]]]  # column 0 is a sink, 6 and 9 are recent
    evict = policy.select_decode(scores, columns, torch.tensor([5]), column=9, first_real=torch.tensor([0]))
    assert not evict.any()
    assert policy.decode_scores(scores, torch.ones_like(scores), step=3).sub(scores).eq(1).all()


def test_snapkv_recompression_cuts_back_to_the_budget_at_the_end_of_each_cycle():
    policy = SnapKV(compression=0.5, sink=1, window=2, recompress_every=4)
    assert policy.decode_time and policy.cache_growth(100) == 4 and policy.cache_growth(3) == 3
    assert [policy.evicts_after(step) for step in range(8)] == [False, False, False, True] * 2
    scores = torch.ones(1, 1, 6)
    assert policy.decode_scores(scores, scores, step=1).equal(scores)  # outside the observation window
    assert policy.decode_scores(scores, scores, step=2).equal(scores)  # window opens: reset, then vote
    columns = torch.tensor([[[0, 3, 5, 6, 9, 10]]], dtype=torch.int32)
    votes = torch.tensor([[[0.0, 0.1, 0.9, 0.2, 0.0, 0.0]]])
    evict = policy.select_decode(votes, columns, torch.tensor([4]), column=10, first_real=torch.tensor([0]))
    assert evict.int().tolist() == [[[0, 1, 0, 1, 0, 0]]]  # two over budget: the two lowest unprotected
    with pytest.raises(ValueError, match="recompress_every"):
        SnapKV(window=8, recompress_every=4)


def test_snapkv_votes_come_from_the_observation_window_only():
    key_real = torch.ones(1, 12, dtype=torch.bool)
    view = view_of(key_real)
    policy = SnapKV(compression=0.5, sink=0, window=3, kernel=1)
    expected = eager_attention(view)[:, :, -3:].sum(dim=2).view(1, 2, 2, 12).mean(dim=2)
    torch.testing.assert_close(policy.prefill_scores(view), expected)
    before = policy.prefill_scores(view)
    view.query[:, :, :9] = torch.randn_like(view.query[:, :, :9])  # queries outside the window do not vote
    torch.testing.assert_close(policy.prefill_scores(view), before)
    view.query[:, :, 10] += 1.0
    assert not torch.allclose(policy.prefill_scores(view), before)


def test_every_eviction_yaml_instantiates_its_policy():
    files = sorted(CONF.glob("*.yaml"))
    assert [f.stem for f in files] == ["h2o", "knorm", "none", "random", "recent", "snapkv"]
    for path in files:
        cfg = OmegaConf.merge({"compression": 0.25, "seed": 3}, {"eviction": OmegaConf.load(path)})
        policy = instantiate(cfg.eviction)
        assert isinstance(policy, EvictionPolicy), path
        if path.stem != "none":
            assert policy.compression == 0.25, path
    assert instantiate(OmegaConf.merge({"compression": 0.5, "seed": 3}, {"e": OmegaConf.load(CONF / "random.yaml")}).e).seed == 3


@pytest.mark.parametrize("make", [lambda: H2O(0.5, window=4), lambda: SnapKV(0.5, sink=2, window=4), lambda: KNorm(0.5, window=4)],
                         ids=["h2o", "snapkv", "knorm"])
def test_a_prompt_its_samples_repeat_is_chosen_once_and_the_rollout_is_the_same(make):
    """A policy whose prefill choice depends on the prompt alone scores each distinct prompt once; the rollout (tokens,
    log-probs, shadow mask) is the one that scores every row, and a random policy still scores every row."""
    from smd_cli.eviction.random import RandomEviction
    from smd_cli.model.build import build_tiny_model
    from smd_cli.rollout.sampler import generate

    model = build_tiny_model(300, seed=0, num_hidden_layers=2).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [p for n in (40, 29) for p in [torch.randint(3, 300, (n,), generator=generator).tolist()] * 3]  # 2 prompts x 3
    rows_scored = []

    def rollout(policy):
        real = policy.select_prefill
        policy.select_prefill = lambda view, budget: (rows_scored.append(view.key.shape[0]), real(view, budget))[1]
        return generate(model, prompts, policy=policy, max_new_tokens=6, generator=torch.Generator().manual_seed(1), eos_token_id=-1,
                        pad_token_id=0, measure_dense_kv=False)

    once = rollout(make())
    assert rows_scored == [2, 2]  # one choice per distinct prompt, per layer
    every_row = make()
    every_row.prefill_per_prompt = False
    rows_scored.clear()
    per_row = rollout(every_row)
    assert rows_scored == [6, 6]
    assert torch.equal(once.input_ids, per_row.input_ids) and torch.equal(once.logprobs, per_row.logprobs)
    assert torch.equal(once.evict_at, per_row.evict_at)
    rows_scored.clear()
    rollout(RandomEviction(0.5, window=4))
    assert rows_scored == [6, 6]
