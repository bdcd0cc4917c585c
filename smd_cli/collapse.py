"""Has the policy collapsed? A rule over what a run logs at every step (README, "Collapse is a status").

GRPO learns from the differences between the rewards of a prompt's G samples. A step is *silent* when it gave
the learner nothing to learn from:

- `same`: every group's samples earned the same reward (`frac_reward_zero_std` = 1), so every advantage is 0;
- `dead`: the gradient norm fell to a millionth of the run's largest (float32 rounding of the loss's own
  terms) although rewards still differed within groups: the network no longer responds to its reward (what an
  update too large leaves: saturated weights, exactly or nearly zero gradients).

A run whose last `window` steps are all silent has stopped learning. That is where training ends when the
policy earns the full reward (1) on every sample (converged: zero advantages, zero gradient, never a
collapse), and it is a collapse when the policy is worse than it started: the sampler's mean reward over those
steps is below the first step's (and below 1), or the steps are all dead. The collapse is *certain* (the run
stops at once) when the steps are all dead, or when the policy also samples (almost) deterministically: its
token entropy below 1 % of the first step's, so that no sample can ever differ again. Otherwise it is said at
the end of the run, which then reads "collapsed" too; so does a run that ends with two or more silent steps
below the first step's reward and a held-out reward fallen by half or more. The collapse began at the first
silent step of the streak, `since`: the update of step `since - 1` produced it, so the last good weights are
those of step `since - 2`.

Library code: plain rows in, a verdict out; `smd_cli.stages.train_state` acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass

TINY_GRADIENT = 1e-6  # of the run's largest gradient norm: below it a gradient is rounding noise
LOW_ENTROPY = 0.01  # of the first step's sampling entropy: below it the policy writes (almost) the same thing


@dataclass(frozen=True)
class Collapse:
    since: int  # the first suspect step of the streak (1-based)
    step: int  # the last step judged
    kind: str  # "stuck" or "dead" (of the last step)
    certain: bool
    reason: str

    @property
    def last_good_step(self) -> int:
        """The newest step whose weights predate the collapse (0: the run's starting weights)."""
        return max(self.since - 2, 0)


def _number(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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


def deterministic(rows: list[dict]) -> bool:
    """The last step's sampling entropy is below LOW_ENTROPY of the first step's."""
    first, last = _number(rows[0], "entropy"), _number(rows[-1], "entropy")
    return first is not None and last is not None and first > 0 and last <= LOW_ENTROPY * first


def _mean_reward(rows: list[dict]) -> float | None:
    values = [v for v in (_number(r, "reward") for r in rows) if v is not None]
    return sum(values) / len(values) if values else None


def worse(rows: list[dict], n: int) -> bool:
    """The sampler's mean reward over the last `n` steps is below the first step's and below 1."""
    first, recent = _number(rows[0], "reward"), _mean_reward(rows[-n:])
    return first is not None and recent is not None and recent < min(1.0, first)


def suspect_since(rows: list[dict]) -> int | None:
    """The first step of a trailing streak of silent steps that are not all at the full reward, or None."""
    n = trailing(judge(rows))
    return rows[-n]["step"] if n and _mean_reward(rows[-n:]) != 1.0 else None


def verdict(rows: list[dict], window: int, end: bool = False, held_out: tuple[float, float] | None = None) -> Collapse | None:
    """The collapse the last steps of `rows` show, or None. `certain` (stop now): the last `window` steps are all
    dead, or all silent below the first step's reward with a deterministic policy. At the `end` of a run,
    `window` silent steps below the first step's reward, or two and a held-out reward (`held_out`: before, after)
    fallen by half or more, are a collapse too (not certain: said, the run being over anyway). `window` 0 turns
    the rule off."""
    if window <= 0 or not rows:
        return None
    kinds = judge(rows)
    n = trailing(kinds)
    if n == 0:
        return None
    k = min(n, window)
    dead = n >= window and all(kind == "dead" for kind in kinds[-k:])
    certain = dead or (n >= window and worse(rows, k) and deterministic(rows))
    fell = held_out is not None and held_out[0] > 0 and held_out[1] <= held_out[0] / 2
    if not (certain or (end and worse(rows, k) and (n >= window or (n >= 2 and fell)))):
        return None
    since = rows[-n]["step"]
    return Collapse(since, rows[-1]["step"], "dead" if dead else "same", certain, _reason(rows, n, k, dead, held_out if fell else None))


def _reason(rows: list[dict], n: int, k: int, dead: bool, held_out: tuple[float, float] | None) -> str:
    first, last = rows[0], rows[-1]
    span = f"steps {rows[-n]['step']}-{last['step']}" if n > 1 else f"step {last['step']}"
    if dead:
        largest = max((_number(r, "grad_norm") or 0.0) for r in rows)
        parts = [f"the gradient vanished ({span}: norm {_number(last, 'grad_norm'):.3g}, the run's largest {largest:.3g}) "
                 "although rewards still differed within groups: the network no longer responds to its reward "
                 "(saturated by an update too large)"]
    else:
        parts = [f"the sampler's reward fell from {_number(first, 'reward'):.3g} (step {first['step']}) to a mean of "
                 f"{_mean_reward(rows[-k:]):.3g} over the last {k} steps, and every group's samples earned the same reward "
                 f"({span}), so no advantage is left to learn from"]
    entropy, start = _number(last, "entropy"), _number(first, "entropy")
    if entropy is not None and start is not None:
        parts.append(f"token entropy {entropy:.3g} nats (step {first['step']}: {start:.3g})"
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
