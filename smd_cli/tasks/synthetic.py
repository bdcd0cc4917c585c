"""Synthetic long-context retrieval, generated deterministically from a seed, with a verifiable reward.

A prompt is `prompt_tokens` filler words with `num_needles` marked key-value pairs hidden in it, then a
query for one key; the answer is the marker ANSWER followed by the value:

    f17 f3 ... NEEDLE k12 v40 v7 ... f99 NEEDLE k3 v21 v2 ... f5 QUERY k12   ->   ANSWER v40 v7 <eos>

The marker matters: the first response token is predicted from the last prompt position, computed by the
dense prefill before any eviction (DESIGN.md section 2), so a value given first would always see the whole
prompt. After ANSWER, every value token is predicted from the evicted cache.

With one needle (`NeedleRetrieval`: `NEEDLE v40`, no key) the model only has to find the marker; with several needles and
multi-token values (`MultiNeedleRetrieval`) it must match the queried key among distractors and copy the
value in order, so which prompt entries an eviction policy keeps (and in what order it evicts them)
decides whether the answer is still reachable. Every word is a single token of the tiny tokenizer
(`smd_cli.model.build.tiny_words`). The reward is the fraction of value tokens reproduced in place
(1.0 = exact answer, extra words count as wrong ones), a dense signal that GRPO can climb.
"""

from __future__ import annotations

import random

from smd_cli.model.build import N_FILLER, N_KEYS, N_VALUES
from smd_cli.tasks.base import Example, Task

SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}


class MultiNeedleRetrieval(Task):
    """Several key-value needles in filler; answer the value of the queried key."""

    name = "multi_needle"

    def __init__(
        self,
        prompt_tokens: int = 256,
        num_needles: int = 4,
        value_tokens: int = 2,
        num_filler: int = N_FILLER,
        num_keys: int = N_KEYS,
        num_values: int = N_VALUES,
        size: dict[str, int] | None = None,
        seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        needle_len = (2 if num_needles > 1 else 1) + value_tokens
        if not 1 <= num_needles <= num_keys:
            raise ValueError(f"task.num_needles={num_needles}: must be in [1, num_keys={num_keys}]")
        if value_tokens < 1:
            raise ValueError(f"task.value_tokens={value_tokens}: must be >= 1")
        if prompt_tokens < num_needles * needle_len + 8:
            raise ValueError(
                f"task.prompt_tokens={prompt_tokens}: too short for {num_needles} needles of {needle_len} tokens "
                f"(need >= {num_needles * needle_len + 8})"
            )
        for key, value, limit in (("num_filler", num_filler, N_FILLER), ("num_keys", num_keys, N_KEYS), ("num_values", num_values, N_VALUES)):
            if not 1 <= value <= limit:
                raise ValueError(f"task.{key}={value}: must be in [1, {limit}] (the tiny tokenizer's vocabulary)")
        self.prompt_tokens, self.num_needles, self.value_tokens = prompt_tokens, num_needles, value_tokens
        self.num_filler, self.num_keys, self.num_values = num_filler, num_keys, num_values
        self.size = {"train": 100_000, "validation": 256, "test": 256, **(size or {})}
        self.seed = seed

    def example(self, split: str, index: int) -> Example:
        """The `index`-th example of `split`: a pure function of (seed, split, index)."""
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split={split!r}: the synthetic tasks have splits {sorted(SPLIT_SEEDS)}")
        rng = random.Random(f"{self.name}/{self.seed}/{SPLIT_SEEDS[split]}/{index}")
        keys = rng.sample(range(self.num_keys), self.num_needles)
        values = [[rng.randrange(self.num_values) for _ in range(self.value_tokens)] for _ in keys]
        # One needle needs no key (the marker alone finds it); several are told apart by their keys.
        needles = [["NEEDLE"] + ([f"k{k}"] if self.num_needles > 1 else []) + [f"v{v}" for v in vs] for k, vs in zip(keys, values)]
        query = ["QUERY", f"k{keys[0]}"] if self.num_needles > 1 else ["QUERY"]
        n_filler = self.prompt_tokens - sum(map(len, needles)) - len(query)
        words = [f"f{rng.randrange(self.num_filler)}" for _ in range(n_filler)]
        # Needles at distinct filler boundaries, inserted back to front so earlier offsets stay valid.
        offsets = sorted(rng.sample(range(n_filler + 1), self.num_needles), reverse=True)
        order = rng.sample(range(self.num_needles), self.num_needles)
        for offset, which in zip(offsets, order):
            words[offset:offset] = needles[which]
        # the queried needle's own words (its key and values; the value alone with one needle)
        start = offsets[order.index(0)] + sum(len(needles[w]) for o, w in zip(offsets, order) if o < offsets[order.index(0)])
        evidence = list(range(start + 1, start + len(needles[0])))
        answer = " ".join(f"v{v}" for v in values[0])
        return {
            "id": f"{self.name}-{split}-{index}",
            "prompt": " " + " ".join(words + query),
            "reference": " ANSWER " + answer,
            "needle_offsets": sorted(offsets),
            "evidence": evidence,
        }

    def examples(self, split: str, limit: int | None = None, start: int = 0) -> list[Example]:
        n = self.size.get(split, 0) if limit is None else limit
        return [self.example(split, start + i) for i in range(n)]

    def evidence_positions(self, example: Example, prompt_ids: list[int]) -> list[int]:
        """Token positions in `prompt_ids` (from `encode_prompt`) of the words the answer is read from
        (`example["evidence"]`, word indices): one token per word, the words last."""
        return [len(prompt_ids) - len(example["prompt"].split()) + i for i in example.get("evidence", [])]

    def reward(self, completion: str, example: Example) -> float:
        """0 without the leading ANSWER marker; else the value tokens reproduced in place over
        max(len(given), len(value)): 1.0 only for the exact answer, partial credit for a partly right one,
        and extra words cost as much as wrong ones."""
        got, want = completion.split(), example["reference"].split()
        if not got or got[0] != want[0]:
            return 0.0
        got, want = got[1:], want[1:]
        return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


class NeedleRetrieval(MultiNeedleRetrieval):
    """One marked value (`NEEDLE v40`) in filler; answer it (`ANSWER v40`)."""

    name = "needle"

    def __init__(self, prompt_tokens: int = 256, value_tokens: int = 1, **kwargs):
        super().__init__(prompt_tokens=prompt_tokens, num_needles=1, value_tokens=value_tokens, **kwargs)


class MajorityVote(MultiNeedleRetrieval):
    """`num_marks` marked values (`NEEDLE v`) in filler, `majority` of them equal and the others distinct;
    answer the value marked most often (`ANSWER v`).

    The answer is computed from several prompt positions rather than copied from one: an eviction that keeps
    some of the majority's copies may still leave it recoverable, one that keeps more of the minority's may
    not, so the reward under eviction falls with how much of the evidence survives instead of all at once."""

    name = "vote"

    def __init__(self, prompt_tokens: int = 256, num_marks: int = 5, majority: int = 3, **kwargs):
        super().__init__(prompt_tokens=prompt_tokens, num_needles=1, value_tokens=1, **kwargs)
        if not 2 * majority > num_marks >= majority >= 1:
            raise ValueError(f"task.majority={majority}: must be a strict majority of task.num_marks={num_marks}")
        if num_marks - majority + 1 > self.num_values:
            raise ValueError(f"task.num_marks={num_marks}: needs {num_marks - majority + 1} distinct values, "
                             f"task.num_values={self.num_values}")
        if prompt_tokens < 2 * num_marks + 8:
            raise ValueError(f"task.prompt_tokens={prompt_tokens}: too short for {num_marks} marks (need >= {2 * num_marks + 8})")
        self.num_marks, self.majority = num_marks, majority

    def example(self, split: str, index: int) -> Example:
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split={split!r}: the synthetic tasks have splits {sorted(SPLIT_SEEDS)}")
        rng = random.Random(f"{self.name}/{self.seed}/{SPLIT_SEEDS[split]}/{index}")
        answer, *others = rng.sample(range(self.num_values), self.num_marks - self.majority + 1)
        marks = [answer] * self.majority + others
        rng.shuffle(marks)
        n_filler = self.prompt_tokens - 2 * self.num_marks - 1
        words = [f"f{rng.randrange(self.num_filler)}" for _ in range(n_filler)]
        offsets = sorted(rng.sample(range(n_filler + 1), self.num_marks))
        for offset, value in zip(reversed(offsets), reversed(marks)):  # back to front: earlier offsets stay valid
            words[offset:offset] = ["NEEDLE", f"v{value}"]
        evidence = [i for i, w in enumerate(words) if w == f"v{answer}"]
        return {
            "id": f"{self.name}-{split}-{index}",
            "prompt": " " + " ".join(words + ["QUERY"]),
            "reference": f" ANSWER v{answer}",
            "needle_offsets": offsets,
            "evidence": evidence,
        }
