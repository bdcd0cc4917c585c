"""The shadow replay's CUDA kernel, compiled flex_attention, run on the CPU (inductor compiles it there too): the
same log-probs as the SDPA replay at several sequence widths in one process, with one compile for all of them
(`dynamic=False` compiled once per width and, at the ninth, fell back to eager flex with [B, H, T, T] scores);
through `shared_prompt_views` (GRPO's rows sharing a prompt, whose response rows flex replays over an [R, T]
grid instead of an SDPA mask copied for every query head); and a compile that fails warns once and replays
with SDPA. The CPU has no flex backward: these are forward passes, as the parity checks run them.

Compiling costs seconds to tens of seconds on the CPU (inductor caches its kernels on disk, so a second run
compiles faster): the shapes are tiny, and the tests that count compiles start from `torch._dynamo.reset()`, so
they hold in any order (xdist)."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.exc import InductorError

from smd_cli.attention import shadow
from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_logits, shadow_and_teacher_hidden
from smd_cli.model.build import build_tiny_model
from smd_cli.rollout.sampler import generate

ROWS = 4


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_tiny_model(len(tiny_tokenizer), seed=1).eval()


def rollout(model, vocab, width, policy, repeats=1, seed=0):
    """ROWS rows of prompts about `width` tokens wide (ragged: left padding), each prompt `repeats` times."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (width - 7 * i,), generator=generator).tolist() for i in range(ROWS // repeats)]
    return generate(model, [p for p in prompts for _ in range(repeats)], policy=policy, max_new_tokens=6,
                    generator=torch.Generator().manual_seed(seed), eos_token_id=-1, pad_token_id=0, measure_dense_kv=False)


def replayed(model, batch, backend):
    with torch.no_grad():
        return response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at, backend)


def compiles() -> int:
    return counters["frames"]["ok"]


def test_compiled_flex_equals_the_sdpa_replay_at_every_width_without_recompiling(model, tiny_tokenizer):
    """Five widths: the first compiles, the second recompiles with the sizes that changed made symbolic (dynamo's
    automatic dynamic shapes), the last three reuse that kernel (`dynamic=False`: a compile per width)."""
    widths = (150, 280, 200, 390, 233)  # 2, 3, 2, 4 and 2 blocks of 128 (plus 6 response tokens)
    batches = [rollout(model, len(tiny_tokenizer), width, H2O(0.5, sink=1, window=4), seed=width) for width in widths]
    torch._dynamo.reset()  # count from a fresh compile, whatever ran before in this process
    assert len({b.input_ids.shape[1] for b in batches}) == len(widths)
    compiled = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to SDPA fails the test
        for batch in batches:
            before = compiles()
            flex = replayed(model, batch, "flex")
            compiled.append(compiles() - before)
            sdpa = replayed(model, batch, "sdpa")
            assert (flex - sdpa).abs().max() <= 1e-5
    assert compiled[0] == 1, "the flex replay did not run the compiled kernel"
    assert compiled[1] <= 1 and compiled[2:] == [0, 0, 0], compiled
    assert shadow.flex_failure() is None


def test_compiled_flex_replays_the_response_rows_of_shared_prompts(model, tiny_tokenizer):
    """G = 2 samples per prompt: the learner computes each prompt once and replays the response rows alone, with flex
    when asked (before, `shared_prompt_views` replayed with SDPA whatever the backend)."""
    used = []
    flex = shadow._flex

    def spy(query, *args, **kwargs):
        used.append(query.shape[2])
        return flex(query, *args, **kwargs)

    batch = rollout(model, len(tiny_tokenizer), 160, SnapKV(0.5, sink=2, window=4), repeats=2, seed=5)
    R = batch.input_ids.shape[1] - batch.prompt_length
    args = (model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        shadow._flex = spy
        try:
            with torch.no_grad():
                flex_views = shadow_and_teacher_hidden(*args, "flex")
                flex_logits = response_logits(*args, backend="flex")
        finally:
            shadow._flex = flex
    assert used and set(used) == {R}, used  # every layer, the response rows alone
    with torch.no_grad():
        sdpa_views = shadow_and_teacher_hidden(*args, "sdpa")
        sdpa_logits = response_logits(*args, backend="sdpa")
    assert (flex_logits - sdpa_logits).abs().max() <= 1e-5
    for got, want in zip(flex_views, sdpa_views):
        assert (got - want).abs().max() <= 1e-5
    dense = response_logits(model, *args[1:4])
    assert (dense - sdpa_logits).abs().max() > 1e-3  # the mask matters: flex replayed it, not dense attention


def test_another_batch_size_compiles_without_falling_back(model, tiny_tokenizer):
    """A micro-batch of another size at the same width (the last micro-batch of a step): a symbolic batch size with a
    static width failed the CPU flex template's compile (CppCompileError, then the SDPA fallback); B stays static."""
    torch._dynamo.reset()  # from a fresh compile, whatever ran before in this process
    batch = rollout(model, len(tiny_tokenizer), 170, H2O(0.5, sink=1, window=4), seed=9)
    fields = ("input_ids", "attention_mask", "response_mask", "logprobs", "evict_at")
    small = type(batch)(**{**vars(batch), **{name: getattr(batch, name)[:2] for name in fields}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for rows in (batch, small):
            flex = replayed(model, rows, "flex")
            assert (flex - replayed(model, rows, "sdpa")).abs().max() <= 1e-5
    assert shadow.flex_failure() is None


def test_a_failed_compile_warns_once_and_replays_with_sdpa(model, tiny_tokenizer, monkeypatch):
    def broken(*args, **kwargs):  # a compile failure as inductor reports it (an OOM or a CUDA error propagates instead:
        raise InductorError(RuntimeError("no C++ compiler found"), None)  # tests/test_shadow_flex_errors.py)

    monkeypatch.setattr(shadow, "_compiled_flex", broken)
    monkeypatch.setattr(shadow, "_flex_failure", None)
    monkeypatch.setattr(shadow, "_warned", set())
    batch = rollout(model, len(tiny_tokenizer), 150, H2O(0.5, sink=1, window=4))
    with pytest.warns(RuntimeWarning, match="compiled flex_attention failed .InductorError: RuntimeError: no C.. compiler found.") as caught:
        first = replayed(model, batch, "flex")
        second = replayed(model, batch, "flex")
    assert len([w for w in caught if "flex" in str(w.message)]) == 1
    assert "no C++ compiler" in shadow.flex_failure()
    sdpa = replayed(model, batch, "sdpa")
    assert torch.equal(first, sdpa) and torch.equal(second, sdpa)


def test_the_cpu_replays_with_sdpa_where_a_gradient_is_needed(model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(shadow, "_warned", set())
    batch = rollout(model, len(tiny_tokenizer), 150, H2O(0.5, sink=1, window=4))
    args = (model, batch.input_ids, batch.attention_mask, batch.prompt_length, batch.evict_at)
    with pytest.warns(RuntimeWarning, match="no backward on the CPU"):
        logits = response_logits(*args, backend="flex")
    assert logits.requires_grad and shadow.flex_failure() is None  # flex stays on for forward passes
    torch.testing.assert_close(logits.detach(), replayed(model, batch, "sdpa"), rtol=0, atol=1e-6)
