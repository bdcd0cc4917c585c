"""GSM8K (Cobbe et al. 2021; Hub `openai/gsm8k`, config `main`): grade-school maths, reward = accuracy.

The gold answer is the number after `####` in the solution (commas removed); a completion is scored by
the same extraction with the `\\boxed{}` and last-number fallbacks (`smd_cli.tasks.metrics.gsm8k_accuracy`).
The prompt asks for the dataset's own `#### N` final line so the strict extraction applies.
`math_verify=True` judges completions with Hugging Face's `math-verify` instead (optional extra).
"""

from __future__ import annotations

from typing import Any, ClassVar

from smd_cli.tasks.base import Example
from smd_cli.tasks.datafiles import FieldTypes
from smd_cli.tasks.loading import HubTask
from smd_cli.tasks.metrics import GSM8K_ACCURACY, GSM8K_ACCURACY_MATH_VERIFY, extract_gsm8k_answer

INSTRUCTION = (
    "Solve the problem step by step. On the last line, give the final answer as a number in the form "
    '"#### <number>".'
)


class GSM8K(HubTask):
    """GSM8K: splits train (7,473) / test (1,319); fields `question`, `answer`."""

    name = "gsm8k"
    hub_id = "openai/gsm8k"
    hub_config = "main"
    splits = ("train", "test")
    train_split, test_split = "train", "test"
    field_types: ClassVar[FieldTypes] = {"question": str, "answer": str}
    metric_list = (GSM8K_ACCURACY,)

    def __init__(self, math_verify: bool = False, **kwargs):
        super().__init__(**kwargs)
        if math_verify:
            import importlib.util

            if importlib.util.find_spec("math_verify") is None:
                raise ImportError("task.math_verify=true needs the `math-verify` package: pip install math-verify")
            self.metric_list = (GSM8K_ACCURACY_MATH_VERIFY,)
        self.math_verify = math_verify

    def to_example(self, row: dict[str, Any], fallback_id: str) -> Example:
        reference = extract_gsm8k_answer(row["answer"])
        if reference is None:
            raise ValueError(f"field 'answer' holds no final '#### N' number: {row['answer'][-80:]!r}")
        example = {"id": fallback_id, "question": row["question"], "solution": row["answer"], "reference": reference}
        example["prompt"] = self.build_prompt(example, "")
        return example

    def build_prompt(self, example: Example, document: str) -> str:
        return f"{example['question'].strip()}\n\n{INSTRUCTION}"
