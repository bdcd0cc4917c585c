"""Few-row matmuls round as many-row ones (`smd_cli/model/row_floor.py`), which makes the sampler's decode steps and the
learner's small groups compute each row as the learner's whole-sequence replay does."""

import copy

import torch
import torch.nn.functional as F

from smd_cli.model import row_floor
from smd_cli.model.build import WideLogits


def test_every_row_count_rounds_as_a_large_batch_does():
    """The reference is a plain `F.linear` over 256 rows (what the learner's replay multiplies): a floored layer gives
    those rows' results bit for bit from any number of rows, with and without a bias and with leading batch axes."""
    torch.manual_seed(0)
    for bias in (False, True):
        layer = torch.nn.Linear(576, 1536, bias=bias)
        x = torch.randn(256, 576)
        large = F.linear(x, layer.weight, layer.bias)
        row_floor.apply(torch.nn.Sequential(layer))
        assert type(layer) is row_floor.FlooredLinear
        with torch.no_grad():
            for rows in (1, 2, 3, 7, 8, 15, 16, 31, 40):
                assert torch.equal(layer(x[:rows]), large[:rows]), rows
            assert torch.equal(layer(x[:8].view(8, 1, 576)), large[:8].view(8, 1, 1536))  # a decode step's [N, 1, D]
        assert layer(x[:0]).shape == (0, 1536)


def test_the_floor_is_the_smallest_batch_that_rounds_as_a_large_one():
    """Below the floor found, some batch rounds otherwise (the kernel switch it works around); from it on, none does."""
    torch.manual_seed(1)
    weight = torch.randn(1536, 576)
    x = torch.randn(256, 576)
    large = F.linear(x, weight)
    floor = row_floor.floor_of(weight)
    assert all(torch.equal(F.linear(x[:rows], weight), large[:rows]) for rows in range(floor, 48))
    if floor > 1:  # this machine's BLAS switches kernels below `floor` rows (MKL: 16)
        assert not all(torch.equal(F.linear(x[:rows], weight), large[:rows]) for rows in range(1, floor))


def test_gradients_state_dicts_and_copies_are_a_linear_layers():
    torch.manual_seed(2)
    plain = torch.nn.Linear(32, 16)
    floored = copy.deepcopy(plain)
    row_floor.apply(torch.nn.Sequential(floored))
    x = torch.randn(3, 32)
    plain(x).square().sum().backward()
    floored(x).square().sum().backward()
    torch.testing.assert_close(floored.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-6)
    assert floored.state_dict().keys() == plain.state_dict().keys()
    double = copy.deepcopy(floored).double()  # the float64 replay's copy: floored in float64
    assert type(double) is row_floor.FlooredLinear and double(x.double()).dtype == torch.float64


def test_other_layers_keep_their_own_forward():
    """A subclass (a LoRA or quantised layer, remote code) is left alone; a `WideLogits` head floors its wide matmul."""
    class Own(torch.nn.Linear):
        pass

    own = Own(64, 512)
    row_floor.apply(torch.nn.Sequential(own))
    assert type(own) is Own
    torch.manual_seed(3)
    head = torch.nn.Linear(576, 4096, bias=False)
    head.__class__ = WideLogits
    h = torch.randn(64, 576)
    large = F.linear(h.double(), head.weight.double())
    with torch.no_grad():
        assert all(torch.equal(head(h[:rows]), large[:rows]) for rows in (1, 4, 8, 20))


def test_every_row_count_rounds_as_the_large_batch_in_float32_and_float64():
    """Whatever rule this machine's BLAS needs (a floor, as MKL's 16 rows; or a multiple of rows, as float64 on an AMD
    EPYC, where only batches of 4k rows agree), `linear` returns each row as a 64-row batch computes it."""
    torch.manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        weight, x = torch.randn(1536, 576, dtype=dtype), torch.randn(64, 576, dtype=dtype)
        large = F.linear(x, weight)
        assert all(torch.equal(row_floor.linear(x[:rows], weight, None), large[:rows]) for rows in range(1, 41)), dtype
