"""`smd train` holds its learner to the sampler's policy every step (DESIGN.md contracts 1 and 6).

An algorithm whose learner scores the sampler's own view (SMD's shadow replay; a dense learner of dense, full-precision rollouts)
logs that parity every step: `mismatch/max_abs_diff`, the largest |log p_learner - log p_sampler| of its first
pass. `ParityGuard` judges it against the contract's bound, `guard.parity_bound` (null: `smd check-parity`'s
`parity.bound`, 1e-5 in float32), the way check-parity judges a miss: the next step's rollout, drawn at the
weights the learner scores, is replayed with the model in float64 (`smd_cli.parity.float64_replay`). A float64
replay that misses the sampler beyond the bound and beyond ROUNDING_FACTOR times the learner's own float32
rounding is a mask error (`smd_cli.parity.mask_error`): the learner is not the sampler's policy, and the run stops
with status `parity_broken`, never `completed`. Otherwise the miss was float32 rounding, and from then on the run
holds its parity to that rounding scale (ROUNDING_FACTOR times it), which the status reason says.

The float64 copy of the model is affordable for float32 (or float64) runs of one process; a half-precision or
multi-process run is judged against `guard.parity_bound` alone when one is set (its rounding has no contract
bound), and says it is not judged otherwise. Algorithms whose learner views something else than the sampler
(naive sparse and the corrections: a dense learner of evicting rollouts) have no parity to hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from smd_cli.parity import ROUNDING_FACTOR, float64_replay, mask_error

CHECK_PARITY_BOUND = 1.0e-5  # conf/check_parity.yaml parity.bound: DESIGN.md contract 1, float32


@dataclass
class ParityGuard:
    judged: bool  # the learner views what the sampler ran
    bound: float | None  # the contract's bound; None: not judged (half precision without guard.parity_bound)
    float64: bool  # a miss is judged by the float64 replay (else it breaks the contract at once)
    temperature: float = 1.0
    logits_chunk: int | None = None
    allowed: float = 0.0  # the bound held now: `bound`, or the rounding scale a float64 replay measured
    pending: tuple[int, float] | None = None  # (step, parity) of a miss awaiting the float64 replay
    broken: str | None = None  # why the learner is not the sampler's policy
    broken_at: int | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: DictConfig, dtype: str, processes: int) -> ParityGuard:
        quantised = (cfg.get("kv") or {}).get("quant", "none") != "none"  # a dense learner of an 8-bit rollout: its mismatch is the
        judged = cfg.algo.view == "shadow" or (not cfg.algo.evicting and not quantised)  # quantisation's, reported, not judged
        explicit = cfg.guard.get("parity_bound")
        full = dtype in ("float32", "float64") and processes == 1
        bound = explicit if explicit is not None else CHECK_PARITY_BOUND if dtype in ("float32", "float64") else None
        guard = cls(judged=judged and bound is not None, bound=bound, float64=full, temperature=float(cfg.sampling.temperature),
                    logits_chunk=cfg.grpo.logits_chunk)
        guard.allowed = bound or 0.0
        if judged and bound is None:
            guard.notes.append(f"parity not judged: {dtype} compute has no contract bound (set guard.parity_bound)")
        return guard

    def observe(self, step: int, metrics: dict) -> None:
        """Step `step`'s logged parity: beyond the bound held now, a miss to judge (or, without the float64 replay,
        the contract broken)."""
        value = metrics.get("mismatch/max_abs_diff")
        if not self.judged or self.broken or not isinstance(value, (int, float)) or value <= self.allowed:
            return
        if self.float64:
            self.pending = self.pending or (step, float(value))
            return
        self._break(step, f"at step {step} the learner's parity max |log p_learner - log p_sampler| was {value:.3g}, above "
                          f"guard.parity_bound={self.bound:g}")

    def judge(self, model, batch) -> None:
        """Judge a pending miss on `batch`, a rollout drawn at the weights `model` holds now (before its update)."""
        if self.pending is None or self.broken:
            return
        step, value = self.pending
        self.pending = None
        wide = float64_replay(model, batch, self.temperature, self.logits_chunk)
        if mask_error({"shadow_float64": wide}, self.bound):
            self._break(step, f"at step {step} the learner's parity max |log p_learner - log p_sampler| was {value:.3g}, above "
                              f"the bound {self.bound:g}, and the float64 replay of the next rollout misses the sampler by "
                              f"{wide['max_abs_diff']:.3g} (float32 rounding {wide['rounding']:.3g}): a mask error, not rounding")
            return
        self.allowed = max(self.allowed, ROUNDING_FACTOR * wide["rounding"], value)
        self.notes.append(f"parity {value:.3g} at step {step} is above the bound {self.bound:g}, but the float64 replay is "
                          f"within rounding of the sampler ({wide['max_abs_diff']:.3g}, rounding {wide['rounding']:.3g}): "
                          f"float32 rounding; held to {self.allowed:.3g} from then on")

    def _break(self, step: int, why: str) -> None:
        self.broken_at = step
        self.broken = (f"the learner is not the sampler's policy: {why} (DESIGN.md contract 1; `smd check-parity` with the "
                       "same model shows it per view)")

    def summary(self) -> dict:
        out = {"parity/judged": float(self.judged)}
        if self.judged:
            out.update({"parity/bound": self.bound, "parity/held_to": self.allowed})
        if self.broken:
            out.update({"status": "parity_broken", "status_reason": self.broken, "parity_broken_at_step": self.broken_at})
        return out

    def note(self) -> str:
        return "; ".join(self.notes)
