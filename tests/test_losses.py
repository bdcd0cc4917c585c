"""The loss math against values computed by hand."""

import math

import pytest
import torch

from smd_cli.corrections.sparse_rl import sparse_rl_weights
from smd_cli.corrections.tis import tis_weights
from smd_cli.learner.losses import aggregate, clipped_surrogate, group_advantages, k3_kl


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]), group_size=2)
    # each group of two: mean 0.5, unbiased std sqrt(0.5) = 0.7071; (r - mean) / (std + 1e-4)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0], abs=1e-6)
    centred = group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=2, scale="none")
    assert centred.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        group_advantages(torch.zeros(4), 2, scale="batch")


def test_clipped_surrogate_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([1.0])
    loss, stats = clipped_surrogate(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    # A = +1: -min(r, clip(r, 0.8, 1.28)) -> r=1.5: -1.28; r=0.5: -0.5
    assert loss.flatten().tolist() == pytest.approx([-1.28, -1.28, -0.5, -0.5], abs=1e-6)
    assert stats["high"].tolist() == [[True, True, False, False]] and not stats["low"].any()
    loss, stats = clipped_surrogate(logp, old, -adv, epsilon=0.2, epsilon_high=0.28)
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r)) -> r=1.5: 1.5; r=0.5: 0.8 (the low clip is active)
    assert loss.flatten().tolist() == pytest.approx([1.5, 1.5, 0.8, 0.8], abs=1e-6)
    assert stats["low"].tolist() == [[False, False, True, True]] and not stats["high"].any()


def test_clipped_surrogate_gradient_is_advantage_weighted_score():
    logp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_()
    loss, _ = clipped_surrogate(logp, logp.detach(), torch.tensor([2.0]), 0.2, 0.2)
    loss.sum().backward()
    # at ratio 1 the gradient of -r A w.r.t. logp is -A
    assert logp.grad.flatten().tolist() == pytest.approx([-2.0, -2.0])


def test_k3_by_hand():
    value = k3_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert value.item() == pytest.approx(0.5 - math.log(0.5) - 1)  # exp(d) - d - 1 with d = log(0.25/0.5)
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


def test_aggregate_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", 3, 2).item() == pytest.approx(7 / 3)
    assert aggregate(per_token, mask, "seq_mean_token_mean", 3, 2).item() == pytest.approx((1.5 + 4) / 2)
    # micro-batches with the full-batch normaliser add up to the full-batch value
    parts = sum(aggregate(per_token[i : i + 1], mask[i : i + 1], "token_mean", 3, 2) for i in range(2))
    assert parts.item() == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="loss_agg='sum'"):
        aggregate(per_token, mask, "sum", 3, 2)


def test_sparse_rl_weights_masks_and_veto_by_hand():
    rho = torch.tensor([[1.0, 2.0, 0.4], [1.2, 1e-5, 1.0]])
    sparse = torch.full_like(rho, -1.0)
    weights, keep, stats = sparse_rl_weights(sparse + rho.log(), sparse, torch.ones_like(rho))
    truncated = torch.tensor([[1.0, 1.5, 0.4], [1.2, 1e-5, 1.0]])
    assert weights.flatten().tolist() == pytest.approx((truncated / truncated.mean()).flatten().tolist(), rel=1e-5)
    # tokens outside [0.5, 1.5] masked; row 1 vetoed whole (a rho below 1e-4)
    assert keep.tolist() == [[True, False, False], [False, False, False]]
    assert stats["is/rejected_token_frac"] == pytest.approx(5 / 6)
    assert stats["is/rejected_seq_frac"] == pytest.approx(0.5)


def test_sparse_rl_ignores_padding_in_the_mean():
    rho = torch.tensor([[1.0, 1.5, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, keep, _ = sparse_rl_weights(rho.log(), torch.zeros_like(rho), mask)
    assert weights[0, :2].tolist() == pytest.approx([1.0 / 1.25, 1.5 / 1.25], rel=1e-6)
    assert keep.tolist() == [[True, True, False]]


def test_tis_weights_by_hand():
    weights, stats = tis_weights(torch.log(torch.tensor([[0.5, 3.0]])), torch.zeros(1, 2), torch.ones(1, 2), cap=2.0)
    assert weights.flatten().tolist() == pytest.approx([0.5, 2.0])
    assert stats["is/truncated_token_frac"] == 0.5
