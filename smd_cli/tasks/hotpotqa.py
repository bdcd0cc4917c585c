"""HotpotQA (Yang et al. 2018; Hub `hotpotqa/hotpot_qa`, config `distractor`): multi-hop QA over ten
paragraphs (two gold, eight distractors), reward = token F1 of the official evaluation.

F1 rather than EM is the reward because it gives partial credit (a denser signal for GRPO); both are
reported. The scored prediction is the completion's first non-empty line with a leading `Answer:` removed
(instruct models often restate the label); the official normalisation then applies. The question comes
after the paragraphs, and truncation cuts the end of the paragraphs only.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from smd_cli.tasks.base import Example
from smd_cli.tasks.datafiles import FieldTypes, check_type, describe
from smd_cli.tasks.loading import HubTask
from smd_cli.tasks.metrics import HOTPOT_EM, HOTPOT_F1

INSTRUCTION = "Answer the question using the passages below. Reply with the answer only, in a few words."
_ANSWER_PREFIX = re.compile(r"^\s*(final answer|answer)\s*[:\-]\s*", re.IGNORECASE)


def format_context(context: Any, row_id: str) -> str:
    """The ten paragraphs as `Passage i: title` followed by the joined sentences."""
    if not isinstance(context, dict) or "title" not in context or "sentences" not in context:
        raise KeyError(f"hotpotqa row {row_id}: field 'context' must be {{title: [...], sentences: [[...]]}}, "
                       f"found {describe(context)}")
    titles, sentences = context["title"], context["sentences"]
    try:
        check_type(titles, list, "context.title")
        check_type(sentences, list, "context.sentences")
        for i, title in enumerate(titles):
            check_type(title, str, f"context.title[{i}]")
        for i, paragraph in enumerate(sentences):
            check_type(paragraph, list, f"context.sentences[{i}]")
            for j, sentence in enumerate(paragraph):
                check_type(sentence, str, f"context.sentences[{i}][{j}]")
    except ValueError as err:
        raise ValueError(f"hotpotqa row {row_id}: {err}") from None
    if len(titles) != len(sentences):
        raise ValueError(f"hotpotqa row {row_id}: context has {len(titles)} titles but {len(sentences)} paragraphs")
    return "\n\n".join(
        f"Passage {i + 1}: {title}\n{''.join(sents).strip()}" for i, (title, sents) in enumerate(zip(titles, sentences))
    )


class HotpotQA(HubTask):
    """HotpotQA distractor: splits train (90,447) / validation (7,405, the test split here)."""

    name = "hotpotqa"
    hub_id = "hotpotqa/hotpot_qa"
    hub_config = "distractor"
    splits = ("train", "validation")
    train_split, test_split = "train", "validation"
    field_types: ClassVar[FieldTypes] = {"question": str, "answer": str, "context": dict}
    metric_list = (HOTPOT_F1, HOTPOT_EM)

    def to_example(self, row: dict[str, Any], fallback_id: str) -> Example:
        row_id = row.get("id") or fallback_id
        example = {
            "id": row_id,
            "question": row["question"].strip(),
            "document": format_context(row["context"], row_id),
            "reference": row["answer"],
            "type": row.get("type"),
        }
        example["prompt"] = self.build_prompt(example, example["document"])
        return example

    def build_prompt(self, example: Example, document: str) -> str:
        return f"{INSTRUCTION}\n\n{document}\n\nQuestion: {example['question']}\nAnswer:"

    def prediction(self, completion: str) -> str:
        lines = [line for line in completion.strip().splitlines() if line.strip()]
        return _ANSWER_PREFIX.sub("", lines[0]) if lines else ""
