"""Has the policy collapsed? A rule over what a run logs at every step (README, "Collapse is a status").

GRPO learns from the differences between the rewards of a prompt's G samples. A step is *silent* when it gave
the learner nothing to learn from:

- `same`: every group's samples earned the same reward (`frac_reward_zero_std` = 1), so every advantage is 0;
- `dead`: the gradient norm fell to a millionth of the run's largest (float32 rounding of the loss's own
  terms) although rewards still differed within groups: the network no longer responds to its reward (what an
  update too large leaves: saturated weights, exactly or nearly zero gradients).

Silence alone is no collapse: a prompt the policy always solves and one it always misses make a silent step of a
healthy policy, and a policy that earns the full reward (1) on every sample has converged. The run is judged
against its *baseline*, the mean over its first BASELINE_STEPS logged steps (of the sampler's reward; of the token
entropy), not against one step that may have been lucky. The reward has *fallen* over some steps when their mean is
at most FALLEN (half) of a positive baseline.

- Certain (the run stops at once): the last `window` steps are all dead; or they are all silent, the reward over
  them has fallen, and the policy samples (almost) deterministically (the last step's token entropy at most
  LOW_ENTROPY, 1 %, of the baseline's), so that no sample can ever differ again.
- At the end of a run (said, not stopped; summary status "collapsed"): the last `window` steps silent with the
  reward fallen over them, or two or more silent with the reward fallen and the held-out reward fallen by half;
  or, silent or not, the reward fallen over the last `window` steps after the baseline's (the trend itself:
  partial-credit or ROUGE rewards almost never give a silent step); or, however few steps the run has, the held-out
  reward fallen by half and the gradient vanished (at most TINY_GRADIENT of the run's largest, exactly 0 included) over
  the last steps, whatever their rewards: the updates before destroyed the policy (`smd train steps=4 optim.lr=1e30`,
  whose baseline of 3 steps is itself made of collapsed steps). A held-out reward that rose (after > before)
  overrules these end-of-run signals: the run is not collapsed.

The collapse began at `since`: the first silent step of the streak (for the trend: the first of the trailing steps
whose own reward has fallen, or of the last `window` if that is earlier); the update of step `since - 1` produced it, so the last good weights are those of step `since - 2`.

Library code: plain rows in, a verdict out; `smd_cli.runs.train_state` acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass

TINY_GRADIENT = 1e-6  # of the run's largest gradient norm: below it a gradient is rounding noise
LOW_ENTROPY = 0.01  # of the baseline's sampling entropy: below it the policy writes (almost) the same thing
BASELINE_STEPS = 3  # the first logged steps whose mean reward and entropy a run is judged against
FALLEN = 0.5  # a mean reward at most this fraction of the baseline's has fallen


@dataclass(frozen=True)
class Collapse:
    since: int  # the first suspect step (1-based)
    step: int  # the last step judged
    kind: str  # "same", "dead" (the silent streak's last step), "fell" (the reward trend, no silent streak) or
    # "vanished" (the gradient gone at the end while the held-out reward fell)
    certain: bool
    reason: str

    @property
    def last_good_step(self) -> int:
        """The newest step whose weights predate the collapse (0: the run's starting weights)."""
        return max(self.since - 2, 0)


def _number(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean(rows: list[dict], key: str) -> float | None:
    values = [v for v in (_number(r, key) for r in rows) if v is not None]
    return sum(values) / len(values) if values else None


def judge(rows: list[dict]) -> list[str | None]:
    """Per logged step (rows of `metrics.jsonl`, in step order): "same", "dead" or None (see the module)."""
    largest, kinds = 0.0, []
    for row in rows:
        grad, same = _number(row, "grad_norm"), _number(row, "frac_reward_zero_std")
        if grad is not None:
            largest = max(largest, grad)
        kinds.append("dead" if same is not None and same < 1 and grad is not None and grad <= TINY_GRADIENT * largest
                     else "same" if same == 1 else None)
    return kinds


def trailing(kinds: list[str | None]) -> int:
    """How many of the last steps are silent in a row."""
    n = 0
    for kind in reversed(kinds):
        if kind is None:
            break
        n += 1
    return n


def baseline(rows: list[dict], key: str = "reward") -> float | None:
    """The mean of `key` over the run's first BASELINE_STEPS logged steps."""
    return _mean(rows[:BASELINE_STEPS], key)


def fallen(rows: list[dict], n: int) -> bool:
    """The sampler's mean reward over the last `n` steps is at most FALLEN of a positive baseline."""
    base, recent = baseline(rows), _mean(rows[-n:], "reward") if n else None
    return base is not None and recent is not None and base > 0 and recent <= FALLEN * base


def deterministic(rows: list[dict]) -> bool:
    """The last step's sampling entropy is at most LOW_ENTROPY of the baseline's."""
    base, last = baseline(rows, "entropy"), _number(rows[-1], "entropy")
    return base is not None and last is not None and base > 0 and last <= LOW_ENTROPY * base


def trend(rows: list[dict], window: int) -> bool:
    """The reward has fallen over the last `window` steps, all of them after the baseline's steps."""
    return len(rows) >= BASELINE_STEPS + window and fallen(rows, window)


def _fall_since(rows: list[dict], window: int) -> int:
    """Where a falling trend began: the first of the trailing steps whose reward is at most FALLEN of the
    baseline, or the first of the last `window` steps when that is earlier."""
    low, n = FALLEN * baseline(rows), 0
    for row in reversed(rows[BASELINE_STEPS:]):
        reward = _number(row, "reward")
        if reward is None or reward > low:
            break
        n += 1
    return rows[-max(n, window)]["step"]


def suspect_since(rows: list[dict], window: int) -> int | None:
    """The first step of a trailing streak of silent steps that are not all at the full reward, or of a falling
    reward (`trend`), or None: the step from which the weights are suspect."""
    n = trailing(judge(rows))
    if n and _mean(rows[-n:], "reward") != 1.0:
        return rows[-n]["step"]
    return _fall_since(rows, window) if window > 0 and trend(rows, window) else None


def verdict(rows: list[dict], window: int, end: bool = False, held_out: tuple[float, float] | None = None) -> Collapse | None:
    """The collapse the last steps of `rows` show, or None (the rule is in the module's docstring). `end`: the run
    is over, and `held_out` (the held-out reward before and after, when measured) may confirm or overrule.
    `window` 0 turns the rule off."""
    if window <= 0 or not rows:
        return None
    kinds = judge(rows)
    n = trailing(kinds)
    k = min(n, window)
    dead = n >= window and all(kind == "dead" for kind in kinds[-k:])
    certain = dead or (n >= window and fallen(rows, k) and deterministic(rows))
    if certain:
        return Collapse(rows[-n]["step"], rows[-1]["step"], "dead" if dead else "same", True, _reason(rows, n, k, dead, None))
    if not end or (held_out is not None and held_out[1] > held_out[0]):
        return None
    fell = held_out is not None and held_out[0] > 0 and held_out[1] <= FALLEN * held_out[0]
    if n and fallen(rows, k) and (n >= window or (n >= 2 and fell)):
        return Collapse(rows[-n]["step"], rows[-1]["step"], "same", False, _reason(rows, n, k, False, held_out))
    if trend(rows, window):
        return Collapse(_fall_since(rows, window), rows[-1]["step"], "fell", False, _reason(rows, 0, window, False, held_out))
    gone = vanished(rows)
    if gone and fell:
        return Collapse(rows[-gone]["step"], rows[-1]["step"], "vanished", False, _vanished_reason(rows, gone, held_out))
    return None


def vanished(rows: list[dict]) -> int:
    """How many of the last steps had their gradient vanish (at most TINY_GRADIENT of the run's largest, which is
    positive: some step did learn), whatever their rewards."""
    largest = max((g for g in (_number(r, "grad_norm") for r in rows) if g is not None), default=0.0)
    n = 0
    for row in reversed(rows):
        grad = _number(row, "grad_norm")
        if largest <= 0 or grad is None or grad > TINY_GRADIENT * largest:
            break
        n += 1
    return n


def _vanished_reason(rows: list[dict], n: int, held_out: tuple[float, float]) -> str:
    largest = max(_number(r, "grad_norm") or 0.0 for r in rows)
    parts = [f"the gradient vanished ({_steps(rows[-n:])}: norm {_number(rows[-1], 'grad_norm'):.3g}, the run's largest {largest:.3g}) "
             f"and the held-out reward fell by half or more ({held_out[0]:.3g} -> {held_out[1]:.3g}): the updates before "
             "destroyed the policy, and no gradient is left to repair it"]
    entropy, start = _number(rows[-1], "entropy"), baseline(rows, "entropy")
    if entropy is not None and start is not None:
        parts.append(f"token entropy {entropy:.3g} nats ({_steps(rows[:BASELINE_STEPS])}: {start:.3g})")
    return "; ".join(parts)


def _steps(rows: list[dict]) -> str:
    return f"steps {rows[0]['step']}-{rows[-1]['step']}" if len(rows) > 1 else f"step {rows[0]['step']}"


def _reason(rows: list[dict], n: int, k: int, dead: bool, held_out: tuple[float, float] | None) -> str:
    """Why: the silent streak of the last `n` steps (0: the reward trend over the last `k`), the entropy, and the
    held-out reward when given."""
    early, last = rows[:BASELINE_STEPS], rows[-1]
    if dead:
        largest = max((_number(r, "grad_norm") or 0.0) for r in rows)
        parts = [f"the gradient vanished ({_steps(rows[-n:])}: norm {_number(last, 'grad_norm'):.3g}, the run's largest "
                 f"{largest:.3g}) although rewards still differed within groups: the network no longer responds to its "
                 "reward (saturated by an update too large)"]
    else:
        parts = [f"the sampler's reward fell from a mean of {baseline(rows):.3g} ({_steps(early)}) to a mean of "
                 f"{_mean(rows[-k:], 'reward'):.3g} over the last {k} steps"
                 + (f", and every group's samples earned the same reward ({_steps(rows[-n:])}), so no advantage is left "
                    "to learn from" if n else "")]
    entropy, start = _number(last, "entropy"), baseline(rows, "entropy")
    if entropy is not None and start is not None:
        parts.append(f"token entropy {entropy:.3g} nats ({_steps(early)}: {start:.3g})"
                     + ("; the policy writes the same thing every time" if deterministic(rows) else ""))
    if held_out is not None:
        parts.append(f"held-out reward {held_out[0]:.3g} -> {held_out[1]:.3g}")
    return "; ".join(parts)


def converged(rows: list[dict]) -> str | None:
    """A note when the last step's samples all earned the full reward (1): GRPO has nothing left to learn."""
    if rows and _number(rows[-1], "reward") == 1.0 and _number(rows[-1], "frac_reward_zero_std") == 1:
        n = 0
        for row in reversed(rows):
            if not (_number(row, "reward") == 1.0 and _number(row, "frac_reward_zero_std") == 1):
                break
            n += 1
        return (f"converged: every sample earned the full reward for the last {n} step(s) (from step {rows[-n]['step']}), "
                "so its advantages and gradient are zero; not a collapse")
    return None
