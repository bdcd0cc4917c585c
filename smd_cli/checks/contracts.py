"""DESIGN.md's numeric contracts, in one place: the parity bound of each compute dtype (contract 1), the memory of
SMD's learner against naive sparse's (contract 3). `smd check-parity`, the training run's parity guard and the
reproduction report read them from here; a config key (`parity.bound`, `guard.parity_bound`) overrides the bound of
one run."""

from __future__ import annotations

# the largest |log p_learner - log p_sampler| of SMD's replay, per compute dtype; a dtype missing here has no measured
# bound: its parity is reported, not judged, unless a run sets one (`guard.parity_bound`, `parity.bound`)
PARITY_BOUNDS: dict[str, float] = {"float32": 1.0e-5, "float64": 1.0e-5}
# bounds that hold only with the attention summed in float64 (`model.attention_dtype=float64`, a CPU setting): bf16's
# replay then measured bit for bit the sampler's on SmolLM2, every eviction policy, at 160 and 512 tokens and through
# training steps (results/bf16_cpu.md). With the attention in bf16 the kernels' rounding is larger (6e-4 to 3e-2 on a
# tiny model) and not bounded here: a run there is reported, not judged, as before.
WIDE_ATTENTION_BOUNDS: dict[str, float] = {"bfloat16": 1.0e-5}

# SMD's dynamic learner memory over naive sparse's: the replay's masks cost at most this much
LEARNER_MEMORY_RATIO = 1.05


def contract_bound(dtype: str, attention_dtype: str | None = None) -> float | None:
    """The bound the learner's parity is held to in compute dtype `dtype` with the attention summed in `attention_dtype`
    (None: the compute dtype), or None: not judged."""
    if attention_dtype == "float64" and dtype in WIDE_ATTENTION_BOUNDS:
        return WIDE_ATTENTION_BOUNDS[dtype]
    return PARITY_BOUNDS.get(dtype)


def unbounded(dtype: str) -> str:
    """Why compute dtype `dtype` has no contract bound here, in words for a note or an error."""
    if dtype in WIDE_ATTENTION_BOUNDS:
        return (f"{dtype} compute with the attention summed in {dtype} has no contract bound (smd_cli/checks/contracts.py; "
                f"model.attention_dtype=float64 has one on the CPU)")
    return f"{dtype} compute has no contract bound (smd_cli/checks/contracts.py)"
