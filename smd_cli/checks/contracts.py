"""DESIGN.md's numeric contracts, in one place: the parity bound of each compute dtype (contract 1), the memory of
SMD's learner against naive sparse's (contract 3). `smd check-parity`, the training run's parity guard and the
reproduction report read them from here; a config key (`parity.bound`, `guard.parity_bound`) overrides the bound of
one run."""

from __future__ import annotations

# the largest |log p_learner - log p_sampler| of SMD's replay, per compute dtype; a dtype missing here (float16 today)
# has no measured bound: its parity is reported, not judged, unless a run sets one. bfloat16: the replay measured bit
# for bit the sampler's on SmolLM2 on the CPU, every eviction policy, at 160 and 512 tokens and over training steps
# (results/bf16_cpu.md): the same bound, a miss beyond it judged by the float64 replay as in float32
PARITY_BOUNDS: dict[str, float] = {"float32": 1.0e-5, "bfloat16": 1.0e-5, "float64": 1.0e-5}

# SMD's dynamic learner memory over naive sparse's: the replay's masks cost at most this much
LEARNER_MEMORY_RATIO = 1.05


def contract_bound(dtype: str) -> float | None:
    """The bound the learner's parity is held to in compute dtype `dtype`, or None: not judged."""
    return PARITY_BOUNDS.get(dtype)
