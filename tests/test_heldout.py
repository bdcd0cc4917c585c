"""Which held-out prompts a run evaluates (`smd_cli.evaluation.heldout`, `eval.prompts`): each seed its own block of a generated
task, an independent sample of a finite split, or (fixed) the same first N for every seed; checked against the indices
written out by hand, and through `prompts.held_out_examples` as `smd train` calls it."""

import random

import pytest

from smd_cli.config.prompts import held_out_examples
from smd_cli.config.validation import ConfigError
from smd_cli.evaluation.heldout import DRAWS, LEGACY, draw_of, indices


def test_each_seed_draws_its_own_prompts():
    assert indices("per_seed", 0, 4) == [0, 1, 2, 3] and indices("per_seed", 2, 4) == [8, 9, 10, 11]  # blocks of a generated task
    assert indices("fixed", 5, 4) == [0, 1, 2, 3] and indices("fixed", 5, 4, size=3) == [0, 1, 2]
    drawn = indices("per_seed", 3, 5, size=20)
    assert drawn == sorted(random.Random("held-out prompts/3").sample(range(20), 5))  # a sample of a finite split, by the seed alone
    assert drawn == indices("per_seed", 3, 5, size=20) != indices("per_seed", 4, 5, size=20)
    assert indices("per_seed", 1, 30, size=20) == list(range(20))  # N >= the split: the whole split
    assert DRAWS == ("per_seed", "fixed") and draw_of({"eval": {"num_prompts": 32}}) == LEGACY == "fixed"  # a config from before the key
    assert draw_of({"eval": {"prompts": "per_seed"}}) == "per_seed"
    with pytest.raises(ValueError, match=r"eval.prompts='random' is not allowed: one of per_seed, fixed"):
        indices("random", 0, 4)
    with pytest.raises(ValueError, match=r"seed=-1 is not allowed with eval.prompts=per_seed: an integer >= 0"):
        indices("per_seed", -1, 4)


class Split:
    """A finite test split (a dataset task: no `example(split, i)`), its examples loaded whole or first `limit`."""
    name, test_split = "rows", "test"

    def examples(self, split, limit=None):
        rows = [{"id": f"row-{i}"} for i in range(10)]
        return rows if limit is None else rows[:limit]


def test_held_out_examples_as_train_draws_them():
    """A finite split: the seed's sample of the whole split; fixed: its first N; a bad seed is a config error."""
    assert [e["id"] for e in held_out_examples(Split(), 3, 7, "per_seed")] == [f"row-{i}" for i in indices("per_seed", 7, 3, size=10)]
    assert [e["id"] for e in held_out_examples(Split(), 3, 7, "fixed")] == ["row-0", "row-1", "row-2"]
    assert held_out_examples(Split(), 0, 7, "per_seed") == []
    with pytest.raises(ConfigError, match=r"task=rows split 'test': seed=-2 is not allowed with eval.prompts=per_seed"):
        held_out_examples(Split(), 3, -2, "per_seed")
