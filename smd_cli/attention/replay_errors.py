"""Which errors of the shadow replay's compiled flex_attention (`smd_cli.attention.shadow`) send it to the SDPA replay, and
what the others say.

Only a failed compile falls back (`compile_failure`): torch._dynamo's errors, which wrap inductor's
(`InductorError` around a `LoweringException`, a `CppCompileError`, an `InvalidCxxCompiler`), and inductor's raised
bare. An out-of-memory error propagates with the planner's advice (`out_of_memory_advice`): the SDPA replay builds a
[B, Hkv, R, T] mask per layer, so it needs more memory than flex, not less, and running on it for the rest of the
process would break DESIGN.md's contract 3 silently. A CUDA error (`torch.AcceleratorError`) propagates as it came.
An OOM or a CUDA error inside a compiler error (inductor benchmarks its kernels while it compiles) counts as itself.
"""

from __future__ import annotations

import torch

DEVICE_ERRORS = (torch.OutOfMemoryError, torch.AcceleratorError)


def device_error(err: BaseException) -> BaseException | None:
    """The out-of-memory or CUDA error in the chain of `err` (itself, a compiler error's inner one, its causes)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DEVICE_ERRORS):
            return err
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return None


def compile_failure(err: BaseException) -> bool:
    """Whether `err` is a failure to compile flex_attention, the one reason to replay with SDPA instead."""
    from torch._inductor import exc as inductor

    compile_errors = (torch._dynamo.exc.TorchDynamoException, inductor.CppCompileError, inductor.InvalidCxxCompiler,
                      inductor.OperatorIssue, inductor.SubgraphLoweringException)
    return isinstance(err, compile_errors) and device_error(err) is None


def out_of_memory_advice(err: BaseException, query, key) -> str:
    """The message of an out-of-memory error in the replay of query [B, H, q, D] against key [B, Hkv, T, D]: where
    it happened, and what `smd plan` and the config can do about it."""
    batch, heads, rows, _ = query.shape
    first = (str(err).strip().splitlines() or [""])[0]
    return (f"out of memory in the shadow replay's flex_attention ({batch} sequences x {heads} heads, {rows} query rows over "
            f"{key.shape[2]} keys): the learner's step does not fit this device ({type(err).__name__}: {first}). "
            "`smd plan` with this run's overrides predicts each phase's peak and the largest grpo.micro_batch_size that fits: "
            "lower grpo.micro_batch_size (sequences per forward), then grpo.logits_chunk, or turn on model.gradient_checkpointing "
            "or optim.offload. The SDPA replay is no way out (its [B, Hkv, R, T] mask needs more memory), so none is taken.")
