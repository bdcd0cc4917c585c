"""CUDA's SDPA, imitated on the CPU: the memory-efficient kernel (what a boolean mask selects on CUDA) returns its
output as a transposed [B, M, H, D] buffer, not [B, H, M, D]; other kernels and strided inputs give other layouts.
The SDPA of `smd_cli.attention.kernels` is wrapped to return the very same values in such layouts, and every path that
runs attention goes through it: decode steps (dense and evicting), the shadow replay, SMD's dense teacher rows,
the physical learner, and a whole learner step with its backward. Each must give exactly what it gives with the
CPU's contiguous output (before the fix, `kernels.grouped` raised `view size is not compatible` with GQA)."""

import pytest
import torch

from smd_cli.attention import kernels
from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_logits, shadow_and_teacher_hidden
from smd_cli.learner.physical import physical_response_logits
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.rollout.sampler import generate

SDPA = torch.nn.functional.scaled_dot_product_attention


def memory_efficient(out):
    """[B, H, M, D] values in a [B, M, H, D] buffer (CUDA's memory-efficient and flash kernels)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def padded(out):
    """Rows of a wider buffer: the head dimension strided (an aligned allocation)."""
    return torch.nn.functional.pad(out, (0, 8))[..., : out.shape[-1]]


def sequence_major(out):
    """[B, H, M, D] values in an [M, B, H, D] buffer."""
    return out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


LAYOUTS = {"memory_efficient": memory_efficient, "padded": padded, "sequence_major": sequence_major}


@pytest.fixture(params=sorted(LAYOUTS))
def cuda_layout(request, monkeypatch):
    """SDPA as CUDA runs it: the same values, in another memory layout."""
    relayout = LAYOUTS[request.param]
    calls = []

    def sdpa(*args, **kwargs):
        out = relayout(SDPA(*args, **kwargs))
        calls.append(out.is_contiguous())
        return out

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", sdpa)
    return calls


def test_the_imitation_changes_the_layout_not_the_values():
    out = torch.randn(2, 8, 5, 16)
    for relayout in LAYOUTS.values():
        moved = relayout(out)
        assert torch.equal(moved, out) and not moved.is_contiguous()
    assert memory_efficient(out).stride() == (640, 16, 128, 1)  # [B, M, H, D] underneath


def rollout(model, tokenizer, policy):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=generator).tolist() for n in (40, 40, 33, 33)]
    return generate(model, prompts, policy=policy, max_new_tokens=6, generator=torch.Generator().manual_seed(1), eos_token_id=-1,
                    pad_token_id=0)


@pytest.fixture(scope="module")
def reference(tiny_tokenizer):
    """Everything computed with the CPU's own contiguous SDPA output."""
    from smd_cli.model.build import build_tiny_model

    model = build_tiny_model(len(tiny_tokenizer), seed=2).eval()
    out = {}
    for name, policy in (("dense", None), ("snapkv", SnapKV(0.5, sink=2, window=4)), ("h2o", H2O(0.5, sink=1, window=4))):
        out[name] = rollout(model, tiny_tokenizer, policy)
    return model, out


def _views(model, batch):
    args = (model, batch.input_ids, batch.attention_mask, batch.prompt_length)
    with torch.no_grad():
        shadow, teacher = shadow_and_teacher_hidden(*args, batch.evict_at, "sdpa")
        distinct = slice(1, 3)  # rows 1 and 2 do not share a prompt: the per-row path
        shadow_rows, teacher_rows = shadow_and_teacher_hidden(model, batch.input_ids[distinct], batch.attention_mask[distinct],
                                                              batch.prompt_length, batch.evict_at[distinct], "sdpa")
        return {"replay": response_logits(*args, batch.evict_at), "dense": response_logits(*args), "shadow": shadow, "teacher": teacher,
                "shadow_rows": shadow_rows, "teacher_rows": teacher_rows,
                "physical": physical_response_logits(*args, batch.evict_at)}


def test_decode_replay_teacher_and_physical_learner_under_cuda_layouts(reference, tiny_tokenizer, cuda_layout):
    model, batches = reference
    for name, expected in batches.items():
        policy = {"dense": None, "snapkv": SnapKV(0.5, sink=2, window=4), "h2o": H2O(0.5, sink=1, window=4)}[name]
        got = rollout(model, tiny_tokenizer, policy)  # decode steps: kernels.grouped over the cache's slots
        assert torch.equal(got.input_ids, expected.input_ids), name
        torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=1e-6)
        if expected.evict_at is not None:
            assert torch.equal(got.evict_at, expected.evict_at), name
    assert cuda_layout and not any(cuda_layout)  # every SDPA call returned a non-contiguous layout
    batch = batches["h2o"]  # decode-time evictions: the physical learner evicts at many columns
    got = _views(model, batch)
    kernels.F.scaled_dot_product_attention, patched = SDPA, kernels.F.scaled_dot_product_attention
    try:
        expected = _views(model, batch)
    finally:
        kernels.F.scaled_dot_product_attention = patched
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["naive_sparse", "smd"])
def test_a_learner_step_and_its_backward_under_cuda_layouts(reference, tiny_tokenizer, cuda_layout, name):
    from smd_cli.model.build import build_tiny_model

    _, batches = reference
    batch = batches["snapkv"]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    weights = {}
    for imitated in (True, False):
        if not imitated:
            kernels.F.scaled_dot_product_attention = SDPA  # monkeypatch restores its own wrapper's removal
        model = build_tiny_model(len(tiny_tokenizer), seed=2).eval()
        learner_step(model, torch.optim.SGD(model.parameters(), lr=0.5), batch, advantages, Algorithm(name, max_grad_norm=1e9))
        weights[imitated] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(weights[True], weights[False], rtol=0, atol=1e-6)
