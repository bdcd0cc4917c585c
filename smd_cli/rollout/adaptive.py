"""`compression=adaptive`: the rollout's compression chosen step by step to hold the agreement's lower tail at a target.

A fixed compression is a guess; Sparrow (arXiv 2606.08446) found that RL under a sparse rollout stays stable while
the 5th percentile of the per-token agreement between the sampler and the dense policy (`smd_cli.learner.agreement`) stays
at or above about 0.86, whatever the mean. The controller reads that percentile off each training step's rollout
(at the compression that step ran) and sets the next step's compression:

    c_{t+1} = clamp(c_t + clamp(gain * (p5_t - target), -step, +step), min_compression, max_compression)

so a tail above the target evicts more (less memory), one below it keeps more, by at most `step` a step. It knows
nothing of the eviction policy (it sets the policy's `compression`, the fraction of prompt KV evicted, DESIGN.md
section 2) nor of the algorithm (SMD reads p5 off its own two views; the others get one extra no-grad pass).

The settings (`adaptive.*` in conf/train.yaml), in terms of compression, the fraction of prompt KV EVICTED:
- `min_compression`: the least the rollout evicts, so the MOST KV it ever keeps: the memory ceiling. `smd plan`
  and `smd train`'s memory check budget for it (`fixed`).
- `max_compression`: the most it evicts (the least KV it keeps, the memory floor).
- `start`: the first step's compression (null: `min_compression`, the safe end).
- `target`: the p5 agreement to hold (default Sparrow's 0.86); `step`, `gain`: as in the formula.

Deterministic: the next compression is a function of the state and of p5, which the seeded run reproduces; the
state (the current compression and the last p5) is saved in every checkpoint's trainer state, so a resumed run
continues exactly. Rounded to 1e-9 so that long runs do not drift by float sums.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

ADAPTIVE = "adaptive"  # the value of `compression` that turns the controller on
SIGNAL = "agreement/p5"  # the metric it holds at `target`


def is_adaptive(cfg) -> bool:
    return cfg.get("compression") == ADAPTIVE


def fixed(cfg, compression: float | None = None) -> object:
    """`cfg` itself, or for compression=adaptive a copy at a fixed `compression` (default `adaptive.min_compression`,
    the most KV the rollout keeps: what memory is planned for), so that the eviction policy, the planner and every
    other reader of `compression` see a number."""
    if not is_adaptive(cfg):
        return cfg
    fixed_cfg = copy.deepcopy(cfg)  # an existing key: struct mode lets it be set
    fixed_cfg.compression = float(cfg.adaptive.min_compression if compression is None else compression)
    return fixed_cfg


def at(cfg, controller: "Controller | None") -> object:
    """`cfg` at the controller's current compression (an adaptive run), else `cfg` itself."""
    return cfg if controller is None else fixed(cfg, controller.compression)


def trace(rows: list[dict], most: int = 30) -> str:
    """The logged steps' compression and agreement percentiles, one line a step (the first and last `most` / 2 of a
    longer run), for the console."""
    lines = [f"step {r['step']}: compression {r['compression']:.3f}, agreement p5 {r['agreement/p5']:.4f} p50 {r['agreement/p50']:.4f} "
             f"mean {r['agreement/mean']:.4f}" for r in rows if all(k in r for k in ("compression", "agreement/p5", "agreement/p50",
                                                                                       "agreement/mean"))]
    if len(lines) > most:
        lines = lines[: most // 2] + [f"... ({len(lines) - most} steps)"] + lines[-(most // 2):]
    return "per step, the rollout's compression and its agreement with the dense policy (smd_cli/learner/agreement.py):\n" + "\n".join(lines)


def problem(cfg) -> str | None:
    """What depends on several keys (each key's own rule is in `smd_cli.config.rules`), as the config error's words:
    an evicting algorithm and an eviction policy that evicts (else the controller's compression would be logged while
    every entry is kept), responses of at least 2 tokens (the first is predicted by the dense prefill, so its agreement
    is 1 by construction and would drive the controller), and min_compression <= start <= max_compression; None when all
    is well. Every stage that reads `compression` checks it: train, plan, and a sweep before its first run."""
    if not is_adaptive(cfg):
        return None
    a = cfg.adaptive
    if not cfg.algo.evicting:
        return (f"compression=adaptive is not allowed with algo={cfg.algo.name}: it samples without eviction; use an "
                "evicting algo (naive_sparse, sparse_rl, tis, mis, icepop, trm, smd)")
    if str(cfg.eviction.get("_target_", "")).rsplit(".", 1)[-1] == "KeepAll":
        return ("compression=adaptive is not allowed with eviction=none: it keeps every KV entry whatever the compression, "
                "so the controller would log a compression nothing applies; choose an eviction policy (snapkv, h2o, ...)")
    if cfg.sampling.max_new_tokens < 2:
        return (f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} is not allowed with compression=adaptive: at least 2 "
                "(the first response token is predicted by the dense prefill, so its agreement is 1 whatever the eviction, "
                "and the controller would read only that)")
    if a.min_compression > a.max_compression:
        return (f"adaptive.min_compression={a.min_compression} is not allowed: at most adaptive.max_compression="
                f"{a.max_compression} (min_compression is the least evicted, the most KV kept)")
    if a.start is not None and not a.min_compression <= a.start <= a.max_compression:
        return (f"adaptive.start={a.start} is not allowed: within [adaptive.min_compression, adaptive.max_compression] = "
                f"[{a.min_compression}, {a.max_compression}]")
    return None


@dataclass
class Controller:
    """The compression of the next rollout (`compression`) and how it moves (`update`)."""

    target: float = 0.86
    min_compression: float = 0.3
    max_compression: float = 0.9
    step: float = 0.05
    gain: float = 1.0
    compression: float = math.nan  # the next rollout's; NaN = start at min_compression
    last_signal: float | None = None  # the p5 the last update read

    def __post_init__(self):
        if math.isnan(self.compression):
            self.compression = self.min_compression

    @classmethod
    def of(cls, cfg, state: dict | None = None) -> "Controller | None":
        """The controller of an adaptive run (None for a fixed compression), restored from a checkpoint's `state`."""
        if not is_adaptive(cfg):
            return None
        a = cfg.adaptive
        controller = cls(float(a.target), float(a.min_compression), float(a.max_compression), float(a.step), float(a.gain),
                             math.nan if a.start is None else float(a.start))
        if state:
            controller.load_state_dict(state)
        return controller

    def update(self, signal: float | None) -> float:
        """Move toward holding `signal` (this step's p5 agreement) at the target; returns the next compression. A
        missing or non-finite signal (no response token) leaves it where it is."""
        self.last_signal = signal
        if signal is None or not math.isfinite(signal):
            return self.compression
        move = max(-self.step, min(self.step, self.gain * (signal - self.target)))
        self.compression = round(min(self.max_compression, max(self.min_compression, self.compression + move)), 9)
        return self.compression

    def state_dict(self) -> dict:
        return {"compression": self.compression, "last_signal": self.last_signal}

    def load_state_dict(self, state: dict) -> None:
        self.compression = float(state["compression"])
        self.last_signal = state.get("last_signal")
