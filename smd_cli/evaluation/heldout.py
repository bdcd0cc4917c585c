"""Which held-out prompts a training run evaluates (`eval.prompts`), so that a verdict over seeds is about the task.

`per_seed` (the default): seed s evaluates its own N prompts of the test split. A generated task (passkey, the
synthetic tasks: example i is a pure function of i, and every index is a new example) gives seed s the examples
s N to (s + 1) N - 1, so no two seeds share a prompt; a finite split of M prompts (a dataset's test split) gives
seed s a simple random sample of N of them (without replacement, drawn from the seed alone, so the seeds' samples
are independent; the whole split when N >= M). The runs of one seed evaluate the same prompts, so the paired
difference of two arms still cancels the prompts' difficulty, while the seeds' differences are independent draws
over the task's prompts: a verdict over seeds then keeps its error rate over the task, not only over one prompt set
(`smd_cli.report.stats`'s docstring says why, `tests/test_stats.py` simulates it).

`fixed`: examples 0 to N - 1 for every seed, what every run did before `eval.prompts` existed. A verdict over runs
that evaluated fixed prompts is about those N prompts, and the report says so per comparison.
"""

from __future__ import annotations

import random

DRAWS = ("per_seed", "fixed")
LEGACY = "fixed"  # the draw of every run recorded before eval.prompts existed (its config does not name one)


def indices(draw: str, seed: int, n: int, size: int | None = None) -> list[int]:
    """The indices into the test split of the `n` held-out prompts of a run with this `draw` and `seed`; `size`: the
    split's number of prompts for a finite split, None for a generated task (every index a new example)."""
    if draw not in DRAWS:
        raise ValueError(f"eval.prompts={draw!r} is not allowed: one of {', '.join(DRAWS)}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"eval.num_prompts={n!r} is not allowed: an integer >= 0")
    if size is not None and size < 0:
        raise ValueError(f"the test split's size {size} is not allowed: an integer >= 0")
    count = n if size is None else min(n, size)
    if draw == "fixed":
        return list(range(count))
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is not allowed with eval.prompts=per_seed: an integer >= 0 (seed s evaluates its own "
                         "held-out prompts); eval.prompts=fixed evaluates the same prompts for every seed")
    if size is None:
        return list(range(seed * n, seed * n + n))
    return sorted(random.Random(f"held-out prompts/{seed}").sample(range(size), count))


def draw_of(config: dict) -> str:
    """The draw a run's resolved config (its config.json) records; a config from before `eval.prompts`: LEGACY."""
    value = (config.get("eval") or {}).get("prompts") if isinstance(config, dict) else None
    return LEGACY if value is None else str(value)
