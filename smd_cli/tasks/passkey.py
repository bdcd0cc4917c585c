"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300): a 5-digit key hidden at a
chosen depth of a haystack of a chosen length, then asked for.

The user message, in the model's chat template (the model's own, or the raw text with BOS without one):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you
    about the important information there.
    <haystack: `prompt_tokens` tokens, the key sentence at `depth` of it>
    What is the pass key?

The haystack is the paper's filler ("The grass is green. The sky is blue. The sun is yellow. Here we go. There
and back again.") repeated, or (`haystack: govreport`) the running text of real GovReport reports read from a
local jsonl file. Its length is counted in tokens of the model's tokenizer: `fit_prompt` cuts the text before the
key and the text after it, in tokens, to `depth * prompt_tokens` and the rest, and puts the prompt together from
the token ids of its pieces, so the key's tokens are known exactly. They are the answer-bearing evidence of the
retention diagnostic (`evidence_positions`, both copies of the key), as in the synthetic tasks.

Reward: the first run of digits in the completion against the key, digit by digit in place, over
max(len(given), 5): 1.0 only for the exact key ("2761" for "27611" scores 0.8, "276111" 0.833). Examples are a
pure function of (seed, split, index); each records its key, depth and haystack length.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from smd_cli.tasks.base import EvidenceMemo, Example, Task
from smd_cli.tasks.datafiles import MAX_FILE_BYTES, MAX_ROW_BYTES, DataFileError, check_type, read_rows

SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}
PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key?"
HAYSTACKS = ("filler", "govreport")
DIGITS = re.compile(r"\d+")


class Passkey(Task):
    """A key of `key_digits` digits at `depth` (a fraction, or null: drawn per example) of `prompt_tokens` tokens
    of haystack."""

    name = "passkey"
    built_to_length = True  # `fit_prompt` builds the prompt to `prompt_tokens`: it never cuts one

    def __init__(self, prompt_tokens: int = 256, depth: float | None = None, key_digits: int = 5, haystack: str = "filler",
                 haystack_file: str | None = None, size: dict[str, int] | None = None, seed: int = 0,
                 max_row_bytes: int = MAX_ROW_BYTES, max_file_bytes: int = MAX_FILE_BYTES, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(prompt_tokens, int) or prompt_tokens < 16:
            raise ValueError(f"task.prompt_tokens={prompt_tokens}: the haystack needs >= 16 tokens")
        if depth is not None and not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"task.depth={depth}: a fraction in [0, 1] of the haystack before the key, or null (drawn per example)")
        if not 1 <= key_digits <= 12:
            raise ValueError(f"task.key_digits={key_digits}: must be in [1, 12]")
        if haystack not in HAYSTACKS:
            raise ValueError(f"task.haystack={haystack!r}: one of {', '.join(HAYSTACKS)}")
        if haystack != "govreport" and haystack_file is not None:  # never read: say so rather than run on the filler
            raise ValueError(f"task.haystack_file={haystack_file!r} is not allowed with task.haystack={haystack}, which never reads "
                             "it: set task.haystack=govreport to hide the key in its reports, or task.haystack_file=null")
        self.max_row_bytes, self.max_file_bytes = max_row_bytes, max_file_bytes
        self._reports: list[str] | None = None
        if haystack == "govreport":
            if not haystack_file or not Path(haystack_file).is_file():
                raise ValueError(f"task.haystack_file={haystack_file!r}: task.haystack=govreport reads the reports from a local jsonl "
                                 "file (LEval's gov_report_summ.jsonl, field `input`, or the Hub schema, field `report`)")
            self._reports = reports(Path(haystack_file), max_row_bytes, max_file_bytes)  # a bad file is said now
        self.prompt_tokens, self.depth, self.key_digits = prompt_tokens, None if depth is None else float(depth), key_digits
        self.haystack, self.haystack_file = haystack, haystack_file
        self.size = {"train": 100_000, "validation": 256, "test": 256, **(size or {})}
        self.seed = seed
        self._evidence = EvidenceMemo()  # the answer-bearing token positions of the prompts encoded lately

    # -- examples ----------------------------------------------------------------------------------
    def example(self, split: str, index: int) -> Example:
        """The `index`-th example of `split`. `before` and `after` are more haystack than any tokenizer needs
        (at least one token per word); `fit_prompt` cuts them to the token budget."""
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split={split!r}: the passkey task has splits {sorted(SPLIT_SEEDS)}")
        rng = random.Random(f"{self.name}/{self.seed}/{SPLIT_SEEDS[split]}/{index}")
        key = str(rng.randrange(10 ** (self.key_digits - 1), 10 ** self.key_digits))
        depth = self.depth if self.depth is not None else round(rng.random(), 4)
        before, after, source = self._haystack(rng)
        needle = NEEDLE.format(key=key)
        return {
            "id": f"{self.name}-{split}-{index}",
            "prompt": PREAMBLE + before + needle + after + QUESTION,  # uncut; fit_prompt gives the text the model sees
            "reference": key,
            "key": key, "depth": depth, "haystack_tokens": self.prompt_tokens, "haystack": source,
        }

    def examples(self, split: str, limit: int | None = None, start: int = 0) -> list[Example]:
        n = self.size.get(split, 0) if limit is None else limit
        return [self.example(split, start + i) for i in range(n)]

    def _haystack(self, rng: random.Random) -> tuple[str, str, str]:
        """(text before the key, text after it, where it comes from), each at least `prompt_tokens` words."""
        words = self.prompt_tokens + 8
        if self.haystack == "filler":
            block = len(FILLER.split())
            text = " ".join([FILLER] * (words // block + 1))
            return text, " " + text, "filler"
        reports = self._load_reports()
        which = rng.randrange(len(reports))
        report = reports[which].split()
        need = 2 * words
        start = rng.randrange(max(len(report) - need, 0) + 1)
        text = " ".join((report * (need // max(len(report), 1) + 1))[start : start + need])
        cut = len(text) // 2
        cut = text.index(" ", cut) if " " in text[cut:] else cut
        return text[:cut], text[cut:], f"govreport[{which}]"

    def _load_reports(self) -> list[str]:
        if self._reports is None:
            self._reports = reports(Path(self.haystack_file), self.max_row_bytes, self.max_file_bytes)
        return self._reports

    # -- prompt --------------------------------------------------------------------------------------
    def fit_prompt(self, example: Example, tokenizer) -> tuple[str, list[int]]:
        """(the user message as the model sees it, prompt token ids): the haystack cut, in tokens of `tokenizer`, to
        round(depth * prompt_tokens) tokens before the key sentence and the rest after it; the ids are those of
        the pieces, joined (so the key's positions are exact; the text is their decoding)."""
        def ids(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        text = example["prompt"][len(PREAMBLE) : len(example["prompt"]) - len(QUESTION)]
        needle_text = NEEDLE.format(key=example["key"])
        cut = text.index(needle_text)
        needle = ids(needle_text)
        room = max(example["haystack_tokens"] - len(needle), 0)
        head = round(example["depth"] * room)
        before = ids(text[:cut])[-head:] if head else []
        after = ids(text[cut + len(needle_text) :])[: room - head]
        prefix, suffix = self._template(tokenizer)
        body = ids(PREAMBLE) + before + needle + after + ids(QUESTION)
        prompt_ids = prefix + body + suffix
        key_tokens = self._key_positions(tokenizer, example["key"], needle)
        start = len(prefix) + len(ids(PREAMBLE)) + len(before)
        self._evidence.remember(example, prompt_ids, [start + i for i in key_tokens])
        return tokenizer.decode(body), prompt_ids

    def encode_prompt(self, example: Example, tokenizer) -> list[int]:
        return self.fit_prompt(example, tokenizer)[1]

    def _template(self, tokenizer) -> tuple[list[int], list[int]]:
        """Token ids of the chat template around the user message (system prompt included), or BOS and nothing."""
        if not getattr(tokenizer, "chat_template", None):
            return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []), []
        marker = "\x00PASSKEY\x00"
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [{"role": "user", "content": marker}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        head, tail = text.split(marker)
        return list(tokenizer(head, add_special_tokens=False)["input_ids"]), list(tokenizer(tail, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _key_positions(tokenizer, key: str, needle_ids: list[int]) -> list[int]:
        """Indices in `needle_ids` of the tokens that spell the key (both copies), from the tokens' character spans."""
        spans, position = [], 0
        for i, token in enumerate(needle_ids):
            piece = tokenizer.decode(needle_ids[: i + 1])
            spans.append((position, len(piece)))
            position = len(piece)
        keys = [m.span() for m in re.finditer(re.escape(key), tokenizer.decode(needle_ids))]
        return [i for i, (a, b) in enumerate(spans) if any(a < e and s < b for s, e in keys)]

    def evidence_positions(self, example: Example, prompt_ids: list[int]) -> list[int]:
        """Positions in `prompt_ids` (from `encode_prompt` of this task) of the key's tokens, both copies."""
        return self._evidence.lookup(example, prompt_ids)

    # -- reward ----------------------------------------------------------------------------------------
    def reward(self, completion: str, example: Example) -> float:
        """Digits right in place: the first run of digits of `completion` against the key, over the longer of the two."""
        found = DIGITS.search(completion)
        if found is None:
            return 0.0
        got, want = found.group(), example["key"]
        return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


def reports(path: Path, max_row_bytes: int = MAX_ROW_BYTES, max_file_bytes: int = MAX_FILE_BYTES) -> list[str]:
    """The texts of a haystack file's reports of more than 100 words (field `input`, LEval's, or `report`, the Hub's),
    read row by row (`read_rows`: a bad line is named by file and line, a line above `max_row_bytes` refused unread).
    They are kept in memory, so a file above `max_file_bytes` is refused from its size, before it is read."""
    size = path.stat().st_size
    if size > max_file_bytes:
        raise DataFileError(f"task.haystack_file={str(path)!r} is not allowed: {size} bytes, more than task.max_file_bytes="
                            f"{max_file_bytes} (its reports are kept in memory); raise task.max_file_bytes or give fewer reports")
    rows, where = read_rows(path, None, max_row_bytes, max_file_bytes)
    texts = []
    for row, place in zip(rows, where):
        field = "input" if "input" in row else "report"
        if row.get(field) is None:
            continue
        try:
            check_type(row[field], str, field)
        except DataFileError as err:
            raise DataFileError(f"{place}: {err} (the report's text)") from None
        texts.append(row[field])
    texts = [t for t in texts if len(t.split()) > 100]
    if not texts:
        raise DataFileError(f"task.haystack_file={str(path)!r}: no report with an `input` or `report` field of > 100 words")
    return texts
