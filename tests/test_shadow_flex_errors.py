"""The flex replay's errors, imitated on the CPU as CUDA raises them, through the learner (`learner_step`): an
out-of-memory error propagates with the planner's advice and leaves flex on (before, the broad `except` switched
the process to the SDPA replay for good, whose [B, Hkv, R, T] mask needs more memory); a CUDA error propagates as
it came; only a failed compile falls back to SDPA. And each forward makes its grid's first query column once, not
once per layer (a blocking host-to-device copy per layer on CUDA).

The imitation: the CPU's flex has no backward (compiled or eager), so `shadow._without_backward` says "a GPU" and
the compiled kernel is replaced by what it computes, written with a backward: the layer's `mask_mod` evaluated on
every (query, key) of the grid (`create_mask`; the shared BlockMask holds every causal block, and the mask_mod is
causal itself), then SDPA under that mask. It raises what a test asks of it first."""

import pytest
import torch
from torch._inductor.exc import InductorError, LoweringException
from torch.nn.attention.flex_attention import create_mask

from smd_cli.attention import shadow
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.model.build import build_tiny_model
from smd_cli.rollout.sampler import generate

LAYERS = 3
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    """4 rows: 2 prompts x 2 samples (the learner replays the response rows of each prompt computed once: the [R, T]
    grid, whose first query column is P)."""
    model = build_tiny_model(len(tiny_tokenizer), seed=2, num_hidden_layers=LAYERS).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (40, 33)]
    return generate(model, [p for p in prompts for _ in range(2)], policy=SnapKV(0.5, sink=2, window=4), max_new_tokens=6,
                    generator=torch.Generator().manual_seed(1), eos_token_id=-1, pad_token_id=0)


class GPU:
    """The compiled flex of a GPU: flex_attention's result (with a backward), raising `errors` (one per call, None: run)
    first."""

    def __init__(self, *errors):
        self.errors, self.calls, self.starts = list(errors), 0, []

    def __call__(self, query, key, value, block_mask, scale, enable_gqa):
        self.calls += 1
        if self.errors and (error := self.errors.pop(0)) is not None:
            raise error
        batch, heads, rows, _ = query.shape
        mask = create_mask(block_mask.mask_mod, batch, heads, rows, key.shape[2], device=query.device)  # [B, H, q, T]
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@pytest.fixture
def gpu(monkeypatch):
    """Install a `GPU` (the compiled flex) with the process's flex state fresh; returns the installer."""
    monkeypatch.setattr(shadow, "_without_backward", lambda query: False)
    monkeypatch.setattr(shadow, "_flex_failure", None)
    monkeypatch.setattr(shadow, "_warned", set())
    made = shadow.layer_mask_mod

    def install(*errors):
        kernel = GPU(*errors)
        monkeypatch.setattr(shadow, "_compiled_flex", kernel)
        monkeypatch.setattr(shadow, "layer_mask_mod", lambda evict, groups, start=None: kernel.starts.append(start) or made(evict, groups, start))
        return kernel

    return install


def step(tokenizer, batch, backend="flex", micro_batch_size=None):
    """One SMD learner step on a fresh tiny model; returns its weights after the update."""
    model = build_tiny_model(len(tokenizer), seed=2, num_hidden_layers=LAYERS).eval()
    learner_step(model, torch.optim.SGD(model.parameters(), lr=0.5), batch, ADVANTAGES,
                 Algorithm("smd", max_grad_norm=1e9, replay_backend=backend, micro_batch_size=micro_batch_size))
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 79.19 GiB")


def test_an_out_of_memory_error_propagates_with_the_planners_advice_and_flex_stays_on(gpu, batch, tiny_tokenizer):
    kernel = gpu(oom())
    with pytest.raises(torch.OutOfMemoryError, match=r"shadow replay's flex_attention \(4 sequences x 4 heads, 6 query rows") as caught:
        step(tiny_tokenizer, batch)
    message = str(caught.value)
    assert "`smd plan`" in message and "grpo.micro_batch_size" in message and "Tried to allocate 3.50 GiB" in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert kernel.calls == 1 and shadow.flex_failure() is None
    kernel = gpu()  # the next step (a smaller micro-batch, say) runs flex again: LAYERS calls, no SDPA replay
    after = step(tiny_tokenizer, batch)
    assert kernel.calls == LAYERS and shadow.flex_failure() is None
    torch.testing.assert_close(after, step(tiny_tokenizer, batch, "sdpa"), rtol=0, atol=1e-5)  # the same step, flex or SDPA


def test_an_oom_while_compiling_is_an_oom_too(gpu, batch, tiny_tokenizer):
    """inductor benchmarks its kernels while it compiles: an OOM there reaches the caller inside a compiler error."""
    wrapped = InductorError(oom(), None)
    gpu(wrapped)
    with pytest.raises(torch.OutOfMemoryError, match="smd plan") as caught:
        step(tiny_tokenizer, batch)
    assert caught.value.__cause__ is wrapped and shadow.flex_failure() is None


def test_a_cuda_error_propagates_as_it_came(gpu, batch, tiny_tokenizer):
    error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    kernel = gpu(error)
    with pytest.raises(torch.AcceleratorError) as caught:
        step(tiny_tokenizer, batch)
    assert caught.value is error and kernel.calls == 1 and shadow.flex_failure() is None


def test_a_failed_compile_falls_back_to_sdpa_once_and_for_all(gpu, batch, tiny_tokenizer):
    failed = InductorError(LoweringException(RuntimeError("C++ compile error"), "flex_attention", (), {}), None)
    kernel = gpu(failed)
    with pytest.warns(RuntimeWarning, match="compiled flex_attention failed .InductorError: LoweringException"):
        got = step(tiny_tokenizer, batch)
    assert kernel.calls == 1 and shadow.flex_failure().startswith("InductorError")
    assert torch.equal(got, step(tiny_tokenizer, batch, "sdpa"))  # the failed layer and every later one on SDPA
    step(tiny_tokenizer, batch)
    assert kernel.calls == 1  # not tried again in this process


def test_each_micro_batch_makes_its_first_query_column_once_for_every_layer(gpu, batch, tiny_tokenizer):
    kernel = gpu()
    step(tiny_tokenizer, batch, micro_batch_size=2)
    P = batch.prompt_length
    assert kernel.calls == 2 * LAYERS and len(kernel.starts) == 2 * LAYERS  # 2 micro-batches x LAYERS layers
    made = {id(start): start for start in kernel.starts}  # the distinct tensors (before: one per layer, 6)
    assert len(made) == 2 and [int(start) for start in made.values()] == [P, P]
    assert all(kernel.starts[i] is kernel.starts[0] for i in range(LAYERS))  # the first micro-batch's layers share one
