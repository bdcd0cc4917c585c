"""The task interface shared by the synthetic tiny tasks and the paper's datasets.

An example is a plain dict with at least `id`, `prompt` (the text shown to the model: the user message
for chat models) and `reference` (what the reward compares against); tasks add their own fields.
A task is instantiated from `conf/task/NAME.yaml` (`_target_` names its class); library code never
sees Hydra.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

Example = dict[str, Any]


class Task:
    """Load examples, turn one into prompt token ids, and score a completion.

    Subclasses implement `examples` and `reward`; `metrics` may add task-specific aggregates.
    `reward` returns a float in [0, 1] and is exactly the evaluation metric of one example
    (nanochat's `Task.reward` reuses the evaluation in the same way).
    """

    name: str = "task"
    train_split: str = "train"
    test_split: str = "test"
    higher_is_better: bool = True

    def __init__(self, max_prompt_tokens: int | None = None, max_new_tokens: int = 256, system_prompt: str | None = None):
        if max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens={max_new_tokens}: must be >= 1")
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens  # the task's response budget (sampling.max_new_tokens defaults to it)
        self.system_prompt = system_prompt

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        raise NotImplementedError

    def reward(self, completion: str, example: Example) -> float:
        raise NotImplementedError

    def encode_prompt(self, example: Example, tokenizer) -> list[int]:
        """Prompt token ids: the chat template when the tokenizer has one, else the raw text."""
        text = example["prompt"]
        if getattr(tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": text}
            ]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if tokenizer.bos_token_id is not None:
                ids = [tokenizer.bos_token_id] + ids
        return list(ids)

    def metrics(self, completions: list[str], examples: list[Example]) -> dict[str, float]:
        """Mean reward and exact match (the fraction of rewards of 1: a partly right answer, which the reward credits in
        part, counts 0), each with its standard error; subclasses add their own metrics."""
        scores = [self.reward(c, e) for c, e in zip(completions, examples, strict=True)]
        exact = [float(s >= 1.0) for s in scores]
        return {"reward": mean(scores), "reward_stderr": stderr(scores), "exact": mean(exact), "exact_stderr": stderr(exact)}


class EvidenceMemo:
    """The answer-bearing token positions of the last `size` prompts a task encoded, keyed by (example id, the
    prompt ids), for `evidence_positions`: positions are known while the prompt is built and not after."""

    def __init__(self, size: int = 8192):
        self.size = size
        self._positions: dict[tuple, list[int]] = {}

    @staticmethod
    def _key(example: Example, prompt_ids: list[int]) -> tuple:
        return example["id"], len(prompt_ids), hashlib.sha1(json.dumps(list(prompt_ids)).encode()).hexdigest()

    def remember(self, example: Example, prompt_ids: list[int], positions: list[int]) -> None:
        if len(self._positions) >= self.size:
            self._positions.pop(next(iter(self._positions)))
        self._positions[self._key(example, prompt_ids)] = positions

    def lookup(self, example: Example, prompt_ids: list[int]) -> list[int]:
        try:
            return self._positions[self._key(example, prompt_ids)]
        except KeyError:
            raise ValueError(f"{example['id']}: these prompt ids were not made by this task's encode_prompt") from None


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def stderr(xs: list[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n))."""
    n = len(xs)
    if n < 2:
        return float("nan")
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)
