"""Loading the paper's datasets (Hub or local files of the Hub schema) and fitting prompts to a budget.

`load_rows` reads a split: the Hub id through `datasets.load_dataset` by default, or local
jsonl/json/parquet files (`data_files`) that follow the same schema, read row by row (`datafiles.py`) so
runs and tests work offline and a bad line is named. Each row is checked for the task's fields and their
types (`HubTask.field_types`): an error names the file, the line (or row), the field, the type found and
the type expected, as a ValueError (or KeyError for a missing field) that the stages turn into one
`config error:` line.
`HubTask` is the shared base of the four paper tasks: it holds the loading arguments and truncates the
document part of a prompt (never the instruction or the question) to `max_prompt_tokens` tokens of the
tokenizer actually used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from smd_cli.tasks.base import Example, Task, mean, stderr
from smd_cli.tasks.datafiles import (
    MAX_FILE_BYTES,
    MAX_ROW_BYTES,
    DataFileError,
    FieldTypes,
    check_fields,
    not_a_regular_file,
    read_rows,
)
from smd_cli.tasks.metrics import Metric

DataFiles = str | Path | Sequence[str | Path] | Mapping[str, Any] | None
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _files_for_split(data_files: DataFiles, split: str) -> list[Path]:
    """The local files of `split`: a mapping split -> path(s), or one path (list) used for every split."""
    if isinstance(data_files, Mapping):
        if split not in data_files:
            raise KeyError(f"task.data_files has no entry for split {split!r}; it has {sorted(data_files)}")
        data_files = data_files[split]
    paths = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
    if not paths:
        raise ValueError(f"task.data_files lists no file for split {split!r}")
    return [Path(p) for p in paths]


def _builder(paths: list[Path]) -> str:
    kinds = {_BUILDERS.get(p.suffix.lower()) for p in paths}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"task.data_files must all be one of {sorted(_BUILDERS)} (got {[p.name for p in paths]})"
        )
    return kinds.pop()


def load_rows(
    hub_id: str,
    config: str | None,
    split: str,
    required: Sequence[str] | FieldTypes,
    data_files: DataFiles = None,
    limit: int | None = None,
    max_row_bytes: int = MAX_ROW_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> tuple[list[Example], list[str]]:
    """Rows of one split as dicts, checked for the `required` fields (names, or names -> types) and for
    being non-empty, and where each row is: `FILE, line N` or `HUB_ID split S row index I`. Local files are
    read within `max_row_bytes` per JSON Lines line and `max_file_bytes` per file read whole (`read_rows`)."""
    field_types: FieldTypes = required if isinstance(required, Mapping) else {f: object for f in required}
    if data_files is None:
        rows, where, source, columns = _hub_rows(hub_id, config, split, limit)
    else:
        paths = _files_for_split(data_files, split)
        _builder(paths)  # every file of one known kind
        for p in paths:
            kind = not_a_regular_file(p)
            if kind:
                raise ValueError(f"task.data_files: {str(p)!r} is {kind}, not a regular file (split {split!r})")
            if not p.is_file():
                raise FileNotFoundError(f"task.data_files: no such file {str(p)!r} (split {split!r})")
            if p.stat().st_size == 0:
                raise ValueError(f"task.data_files: file {str(p)!r} is empty (split {split!r})")
        source = f"{[str(p) for p in paths]} split {split!r}"
        rows, where = [], []
        for p in paths:
            more, places = read_rows(p, None if limit is None else limit - len(rows), max_row_bytes, max_file_bytes)
            rows += more
            where += places
            if limit is not None and len(rows) >= limit:
                break
        if not rows:
            raise ValueError(f"{source} is empty (no rows in the file)")
        columns = list(dict.fromkeys(k for row in rows for k in row))
    missing = [f for f in field_types if f not in columns]
    if missing:
        raise KeyError(f"{source}: missing field(s) {missing}; the rows have {columns}")
    if not rows:
        raise ValueError(f"{source} is empty")
    for row, place in zip(rows, where):
        check_fields(row, place, field_types)
    return rows, where


def _hub_rows(hub_id: str, config: str | None, split: str, limit: int | None):
    import datasets

    source = f"{hub_id}" + (f" (config {config})" if config else "") + f" split {split!r}"
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as err:  # re-raised with the way out named
        raise RuntimeError(
            f"could not load {source} from the Hub ({type(err).__name__}: {err}); "
            "give local files of the same schema with task.data_files=..."
        ) from err
    columns = list(ds.column_names)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.to_list(), [f"{source} row index {i}" for i in range(len(ds))], source, columns


class HubTask(Task):
    """A paper task: a Hub dataset (or local files of its schema) and a prompt with an optional document.

    Subclasses set `hub_id`, `hub_config`, `splits` and `field_types` (the schema's required fields and
    their types, checked on every row before `to_example`), and implement `to_example` (one raw row ->
    an example with `id`, `prompt`, `reference`, and `document` when the prompt embeds one) and
    `build_prompt(example, document)`. An error of `to_example` is re-raised naming the file and line of
    the row. `paper` holds the paper-scale training settings of `conf/task/*.yaml` for the record; the
    task itself does not use them.
    """

    hub_id: str = ""
    hub_config: str | None = None
    splits: tuple[str, ...] = ("train", "test")
    field_types: ClassVar[FieldTypes] = {}
    metric_list: tuple[Metric, ...] = ()  # reported by `metrics`; the first is the reward

    def __init__(
        self,
        data_files: DataFiles = None,
        max_prompt_tokens: int | None = None,
        max_new_tokens: int = 256,
        system_prompt: str | None = None,
        paper: Mapping[str, Any] | None = None,
        max_row_bytes: int = MAX_ROW_BYTES,
        max_file_bytes: int = MAX_FILE_BYTES,
    ):
        super().__init__(max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, system_prompt=system_prompt)
        if max_prompt_tokens is not None and max_prompt_tokens <= 0:
            raise ValueError(f"task.max_prompt_tokens must be a positive integer or null, got {max_prompt_tokens}")
        self.data_files = data_files
        self.paper = dict(paper or {})
        self.max_row_bytes, self.max_file_bytes = max_row_bytes, max_file_bytes
        self.places: dict[str, str] = {}  # example id -> where its row is (`FILE, line N`), for errors found later

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        if split not in self.splits:
            raise ValueError(f"{self.name} has splits {list(self.splits)}, not {split!r}")
        rows, where = load_rows(self.hub_id, self.hub_config, split, self.field_types, self.data_files, limit,
                                self.max_row_bytes, self.max_file_bytes)
        examples = []
        for i, (row, place) in enumerate(zip(rows, where)):
            try:
                examples.append(self.to_example(row, f"{self.name}-{split}-{i}"))
            except (KeyError, TypeError, ValueError) as err:  # named with the row's place, never a bare traceback
                raise DataFileError(f"{place}: {err.args[0] if err.args else type(err).__name__}") from err
            self.places[examples[-1]["id"]] = place
        return examples

    def to_example(self, row: dict[str, Any], fallback_id: str) -> Example:
        raise NotImplementedError

    def build_prompt(self, example: Example, document: str) -> str:
        raise NotImplementedError

    def prediction(self, completion: str) -> str:
        """The part of a completion that is scored (the whole of it unless a task says otherwise)."""
        return completion

    def reward(self, completion: str, example: Example) -> float:
        """The task's primary metric (`metric_list[0]`) of one completion: reward = evaluation."""
        return self.metric_list[0](self.prediction(completion), example["reference"])

    def score(self, completion: str, example: Example) -> dict[str, float]:
        """Every metric of `metric_list` for one completion."""
        prediction = self.prediction(completion)
        return {m.name: m(prediction, example["reference"]) for m in self.metric_list}

    @property
    def primary_metric(self) -> Metric:
        return self.metric_list[0]

    def metrics(self, completions: list[str], examples: list[Example]) -> dict[str, float]:
        """Mean and standard error of each metric over examples; `reward` repeats the primary metric."""
        rows = [self.score(c, e) for c, e in zip(completions, examples, strict=True)]
        out: dict[str, float] = {}
        for m in self.metric_list:
            values = [row[m.name] for row in rows]
            out[m.name], out[f"{m.name}_stderr"] = mean(values), stderr(values)
        first = self.metric_list[0].name
        out["reward"], out["reward_stderr"] = out[first], out[f"{first}_stderr"]
        return out

    def encode_prompt(self, example: Example, tokenizer) -> list[int]:
        return self.fit_prompt(example, tokenizer)[1]

    def fit_prompt(self, example: Example, tokenizer) -> tuple[str, list[int]]:
        """(prompt text, token ids) within `max_prompt_tokens`, cutting the end of the document only.

        The document is cut in tokens of `tokenizer`; decoding and re-encoding can shift a boundary by
        a token, so the cut is repeated with the measured overflow until the prompt fits. Nothing longer than
        `reach` characters is tokenised: a longer document is cut to that first (only its start can be kept),
        and a longer prompt without one is refused (`PromptTooLong`) from its length alone.
        """
        budget = self.max_prompt_tokens
        if budget is not None:
            limit = reach(budget, tokenizer)
            document = example.get("document") or ""
            if len(document) > limit:  # what lies past `limit` characters can never be kept
                document = document[:limit]
                example = {**example, "document": document, "prompt": self.build_prompt(example, document)}
            if len(example["prompt"]) - len(document) > limit:
                raise PromptTooLong(self._too_long(example, f"{len(example['prompt']) - len(document)} characters"
                                                            f"{' besides its document' if document else ''}, more than "
                                                            f"{limit} characters always hold", budget))
        ids = super().encode_prompt(example, tokenizer)
        if budget is None or len(ids) <= budget:
            return example["prompt"], ids
        document = example.get("document")
        if not document:
            raise PromptTooLong(self._too_long(example, f"{len(ids)} tokens and has no document to cut", budget))
        doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        keep = len(doc_ids) - (len(ids) - budget)
        while keep > 0:
            prompt = self.build_prompt(example, tokenizer.decode(doc_ids[:keep]))
            ids = super().encode_prompt({**example, "prompt": prompt}, tokenizer)
            if len(ids) <= budget:
                return prompt, ids
            keep -= len(ids) - budget
        empty = super().encode_prompt({**example, "prompt": self.build_prompt(example, "")}, tokenizer)
        raise PromptTooLong(self._too_long(example, f"{len(empty)} tokens without its document", budget))

    def _too_long(self, example: Example, size: str, budget: int) -> str:
        place = self.places.get(example["id"])
        return (f"task.max_prompt_tokens={budget} is not allowed for {self.name} example {example['id']}"
                f"{f' ({place})' if place else ''}: its prompt is {size}; raise task.max_prompt_tokens (within the "
                "model's positions) or leave the example out")


class PromptTooLong(ValueError):
    """A prompt that cannot be fitted to `task.max_prompt_tokens`; the message names the key and the example."""


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for: its longest vocabulary entry (added and special
    tokens included; a byte-level entry's length is its byte count). Computed once per tokenizer."""
    cached = getattr(tokenizer, "_smd_longest_token", None)
    if cached is None:
        cached = max((len(token) for token in tokenizer.get_vocab()), default=1)
        try:
            tokenizer._smd_longest_token = cached
        except AttributeError:
            pass
    return cached


def reach(budget: int, tokenizer) -> int:
    """Characters that always hold more than `budget` tokens: `budget + 1` tokens of the longest kind, with room
    for a normaliser that merges up to 4 characters into one (Unicode NFC composes at most 3)."""
    return 4 * (budget + 1) * longest_token(tokenizer)


def prompt_records(task: Task, examples: list[Example], tokenizer) -> list[dict[str, Any]]:
    """What `prepare-data` writes per example: the prompt text as the model sees it (fitted to the budget,
    before the chat template), its token count (chat template included), whether it was cut, the reference."""
    records = []
    for example in examples:
        if hasattr(task, "fit_prompt"):  # the paper's datasets (cut to a budget), passkey (built to a length)
            text, ids = task.fit_prompt(example, tokenizer)
        else:
            text, ids = example["prompt"], task.encode_prompt(example, tokenizer)
        cut = text != example["prompt"] and not getattr(task, "built_to_length", False)  # passkey, RULER: built, not cut
        records.append({"id": example["id"], "prompt": text, "prompt_tokens": len(ids), "truncated": cut,
                        "reference": example["reference"]})
    return records


def length_stats(lengths: list[int]) -> dict[str, float]:
    """min / mean / median / p95 / max of token counts (nearest-rank percentiles)."""
    if not lengths:
        raise ValueError("no lengths to summarise")
    ordered = sorted(lengths)

    def rank(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])

    return {"min": float(ordered[0]), "mean": sum(ordered) / len(ordered), "p50": rank(0.5), "p95": rank(0.95),
            "max": float(ordered[-1])}
