"""A task's examples and their encoded prompts: a missing split, an empty one or a prompt too long is a config error."""

from __future__ import annotations

from smd_cli.config.validation import ConfigError
from smd_cli.evaluation import heldout
from smd_cli.tasks.loading import PromptTooLong


def load_examples(task, split: str, limit: int | None = None) -> list[dict]:
    """The split's examples; a missing field, file or split, or an empty split, is a config error naming it."""
    try:
        examples = task.examples(split, limit=limit)
    except (KeyError, ValueError, OSError, RuntimeError) as err:  # a missing file or field, an empty split, no Hub
        raise ConfigError(f"task={task.name} split {split!r}: {err.args[0] if err.args else err}") from err
    if not examples:
        raise ConfigError(f"task={task.name} split {split!r} is empty (no examples)")
    return examples


def held_out_examples(task, n: int, seed: int, draw: str) -> list[dict]:
    """The `n` held-out prompts of a run with this `seed` and `eval.prompts` draw (`smd_cli.evaluation.heldout`): a generated task's
    examples by index, a finite split's after loading it whole (its size sets the sample); a config error names the key."""
    if not n:
        return []
    if draw == "fixed":
        return load_examples(task, task.test_split, n)
    pool = None if hasattr(task, "example") else load_examples(task, task.test_split)
    try:
        chosen = heldout.indices(draw, seed, n, None if pool is None else len(pool))
        return [task.example(task.test_split, i) for i in chosen] if pool is None else [pool[i] for i in chosen]
    except (KeyError, ValueError) as err:
        raise ConfigError(f"task={task.name} split {task.test_split!r}: {err.args[0] if err.args else err}") from err


def encode_prompt(task, example: dict, tokenizer) -> list[int]:
    """`task.encode_prompt`, with a prompt that cannot be fitted to `task.max_prompt_tokens` a ConfigError."""
    try:
        return task.encode_prompt(example, tokenizer)
    except PromptTooLong as err:
        raise ConfigError(str(err)) from None


def check_prompts(task, examples: list[dict], tokenizer) -> None:
    """Every example's prompt fits `task.max_prompt_tokens` (else a ConfigError naming it): before any model is
    loaded, so that a long question is said at once. Nothing longer than the budget allows is tokenised."""
    for example in examples:
        encode_prompt(task, example, tokenizer)
