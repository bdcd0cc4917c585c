"""`smd train` holds its learner to the sampler's policy at every step (DESIGN.md contracts 1 and 6).

An algorithm whose learner scores the sampler's own view (SMD's shadow replay; a dense learner of dense, full-precision
rollouts) measures that parity in its first pass: `mismatch/max_abs_diff`, the largest |log p_learner - log p_sampler|.
`ParityGuard` judges it against the bound of the run's compute dtype (`smd_cli.checks.contracts.contract_bound`:
PARITY_BOUNDS, 1e-5 for float32; `guard.parity_bound` overrides it), the way check-parity judges a miss, and on the very batch and
weights of the miss: `learner_step` hands it the first pass's numbers before its update (`check`), and a miss beyond
the bound is replayed in float64 there and then (`smd_cli.checks.parity.float64_replay`, one layer widened at a time: no
float64 copy of the model). The update is not made, and the run stops with status `parity_broken` (never
`completed`), when the float64 replay misses the sampler beyond the bound and beyond ROUNDING_FACTOR times the
learner's own rounding (in its compute dtype) on that batch (a mask error, `smd_cli.checks.parity.mask_error`), or when the replay is within
rounding but the learner's miss is not (`smd_cli.checks.parity.beyond_rounding`: the learner computes something else than
its replay, as a learner with dropout on did). Otherwise the miss was rounding: the run goes on, the miss is recorded
and named in the status reason, and the bound stays where it was. It is never raised (not to a miss, not to a rounding
scale), so every later miss is judged on its own batch again and no run of rounding misses can talk the guard into
passing a mask error.

The guard's record (its bound and every miss judged as rounding) goes into each checkpoint and comes back on resume
(`state_dict`, `load_state_dict`); a bound changed on resume (`guard.*` may change) is said in the status reason.

Several processes (FSDP2) have no float64 replay (the model is sharded): a miss beyond the bound breaks the contract at
once (`observe`, after the step). A compute dtype with no bound (float16; bfloat16 unless the attention is summed in float64) is not
judged unless `guard.parity_bound` is set: its rounding has no contract bound yet. PARITY_BOUNDS is the place for a
dtype's measured bound (bfloat16's: results/bf16_cpu.md); the float64 replay serves any dtype. Algorithms whose learner views something
else than the sampler (naive sparse and the corrections: a dense learner of evicting rollouts) have no parity to hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from smd_cli.checks.contracts import contract_bound, unbounded
from smd_cli.checks.parity import beyond_rounding, float64_replay, mask_error


class ParityBroken(Exception):
    """The learner is not the sampler's policy (`ParityGuard.broken` says why); raised inside `learner_step`, before
    its update."""


def judged_view(cfg: DictConfig) -> bool:
    """Whether the learner of `cfg`'s algorithm views what the sampler ran: SMD's shadow replay, or a dense learner of
    dense, full-precision rollouts (a dense learner of an 8-bit rollout: its mismatch is the quantisation's, reported)."""
    quantised = (cfg.get("kv") or {}).get("quant", "none") != "none"
    return cfg.algo.view == "shadow" or (not cfg.algo.evicting and not quantised)


@dataclass
class ParityGuard:
    judged: bool  # the learner views what the sampler ran, and the dtype has a bound
    bound: float | None  # the bound held, never raised; None: not judged
    replays: bool  # a miss is judged by the float64 replay (one process); else it breaks the contract at once
    temperature: float = 1.0
    logits_chunk: int | None = None
    micro_batch: int | None = None
    misses: list[dict] = field(default_factory=list)  # each miss judged as rounding: step, parity, float64, rounding
    broken: str | None = None  # why the learner is not the sampler's policy
    broken_at: int | None = None
    broken_miss: float | None = None  # the parity that broke it
    notes: list[str] = field(default_factory=list)
    dtype: str = "float32"  # the compute dtype, whose rounding a miss within the float64 replay's is

    @classmethod
    def of(cls, cfg: DictConfig, dtype: str, processes: int) -> ParityGuard:
        explicit = cfg.guard.get("parity_bound")
        bound = explicit if explicit is not None else contract_bound(dtype, cfg.model.get("attention_dtype"))
        judged = judged_view(cfg)
        guard = cls(judged=judged and bound is not None, bound=bound, replays=processes == 1, dtype=dtype,
                    temperature=float(cfg.sampling.temperature), logits_chunk=cfg.grpo.logits_chunk,
                    micro_batch=cfg.grpo.micro_batch_size)
        if judged and bound is None:
            guard.notes.append(f"parity not judged: {unbounded(dtype)} (set guard.parity_bound)")
        return guard

    def check(self, step: int, model, batch):
        """`learner_step`'s `check` for step `step` (1-based) on `batch`, the rollout drawn at the weights `model` holds
        until the step's update: None where a miss is not replayed (then `observe` judges it after the step)."""
        if not (self.judged and self.replays):
            return None
        return lambda first: self.judge(step, first, model, batch)

    def judge(self, step: int, first: dict, model, batch) -> None:
        """Judge step `step`'s parity (`first`: the learner's first pass, `mismatch/*`) on its own batch and weights:
        within the bound, nothing; beyond it, the float64 replay tells rounding (recorded) from a mask error
        (`ParityBroken`)."""
        value = first.get("mismatch/max_abs_diff")
        if self.broken or not isinstance(value, (int, float)) or value <= self.bound:
            return
        wide = float64_replay(model, batch, self.temperature, self.logits_chunk, self.micro_batch)
        if mask_error({"shadow_float64": wide}, self.bound):
            self._break(step, value, f"at step {step} the learner's parity max |log p_learner - log p_sampler| was {value:.3g}, "
                                     f"above the bound {self.bound:g}, and the float64 replay of that step's rollout at the same "
                                     f"weights misses the sampler by {wide['max_abs_diff']:.3g} ({self.dtype} rounding "
                                     f"{wide['rounding']:.3g}): a mask error, not rounding; the step's update was not made")
            raise ParityBroken(self.broken)
        if beyond_rounding(value, wide, self.bound):
            self._break(step, value, f"at step {step} the learner's parity max |log p_learner - log p_sampler| was {value:.3g}, "
                                     f"above the bound {self.bound:g}, while the float64 replay of that step's rollout at the same "
                                     f"weights is within rounding of the sampler ({wide['max_abs_diff']:.3g}, {self.dtype} rounding "
                                     f"{wide['rounding']:.3g}): the learner's forward is not the replay's function (a training-mode "
                                     "behaviour such as dropout or router jitter, or an error of the learner's own path), not "
                                     "rounding; the step's update was not made")
            raise ParityBroken(self.broken)
        self.misses.append({"step": step, "parity": float(value), "float64": wide["max_abs_diff"], "rounding": wide["rounding"]})

    def observe(self, step: int, metrics: dict) -> None:
        """Step `step`'s logged parity where no float64 replay judges it (several processes): beyond the bound, the
        contract is broken."""
        value = metrics.get("mismatch/max_abs_diff")
        if not self.judged or self.replays or self.broken or not isinstance(value, (int, float)) or value <= self.bound:
            return
        self._break(step, value, f"at step {step} the learner's parity max |log p_learner - log p_sampler| was {value:.3g}, "
                                 f"above the bound {self.bound:g} (several processes: no float64 replay tells rounding from a mask error)")

    def _break(self, step: int, value: float, why: str) -> None:
        self.broken_at, self.broken_miss = step, float(value)
        self.broken = (f"the learner is not the sampler's policy: {why} (DESIGN.md contract 1; `smd check-parity` with the "
                       "same model shows it per view)")

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the guard: its bound and the misses judged as rounding so far."""
        return {"bound": self.bound, "misses": [dict(m) for m in self.misses]}

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """Restore the record of a run resumed at step `step` (a checkpoint written before the guard kept one: none)."""
        if not state:
            if step:
                self.notes.append(f"the parity guard's record before step {step} was not in the checkpoint (written by an "
                                  "older smd); misses before it are not counted")
            return
        self.misses = [dict(m) for m in state.get("misses", [])]
        if state.get("bound") != self.bound:
            self.notes.append(f"the parity bound was {_bound(state.get('bound'))} until step {step} and {_bound(self.bound)} after "
                              "(guard.parity_bound changed on resume)")

    def summary(self) -> dict:
        out = {"parity/judged": float(self.judged)}
        if self.judged:
            out.update({"parity/bound": self.bound, "parity/rounding_misses": len(self.misses)})
            if self.misses:
                out["parity/largest_rounding_miss"] = max(m["parity"] for m in self.misses)
        if self.broken:
            out.update({"status": "parity_broken", "status_reason": self.broken, "parity_broken_at_step": self.broken_at,
                        "parity/broken_miss": self.broken_miss})
        return out

    def note(self) -> str:
        """The status reason's words on parity: what was not judged, and every miss judged as rounding."""
        notes = list(self.notes)
        if self.misses:
            worst = max(self.misses, key=lambda m: m["parity"])
            steps = ", ".join(str(m["step"]) for m in self.misses[:10]) + (", ..." if len(self.misses) > 10 else "")
            notes.append(f"parity above the bound {self.bound:g} at {len(self.misses)} step(s) ({steps}; largest {worst['parity']:.3g} "
                         f"at step {worst['step']}), each judged by a float64 replay of its own rollout at its own weights: within "
                         f"rounding of the sampler (float64 replay {max(m['float64'] for m in self.misses):.3g}, {self.dtype} rounding up "
                         f"to {max(m['rounding'] for m in self.misses):.3g}), {self.dtype} rounding, not a mask error; the bound stays "
                         f"{self.bound:g}")
        return "; ".join(notes)


def _bound(value) -> str:
    return "none (not judged)" if value is None else f"{value:g}"
