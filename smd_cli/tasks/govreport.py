"""GovReport (Huang et al. 2021; Hub `ccdv/govreport-summarization`, config `document`, fields
`report`/`summary`): long-document summarisation, reward = ROUGE-L F1.

Reports run to about 9k tokens, so the report sits in the prompt between the instruction and a closing
request (repeated so that the end of the prompt, which SnapKV's observation window sees, names the task);
`max_prompt_tokens` cuts the end of the report only.
"""

from __future__ import annotations

from typing import Any, ClassVar

from smd_cli.tasks.base import Example
from smd_cli.tasks.datafiles import FieldTypes
from smd_cli.tasks.loading import HubTask
from smd_cli.tasks.metrics import ROUGE_L, ROUGE_LSUM, rouge

INSTRUCTION = "Below is a report by a U.S. government agency. Read it and write a one-page summary of it."
CLOSING = "Now write a one-page summary of the report above."


class GovReport(HubTask):
    """GovReport: splits train (17,517) / validation (973) / test (973)."""

    name = "govreport"
    hub_id = "ccdv/govreport-summarization"
    hub_config = "document"
    splits = ("train", "validation", "test")
    train_split, test_split = "train", "test"
    field_types: ClassVar[FieldTypes] = {"report": str, "summary": str}
    metric_list = (ROUGE_L, ROUGE_LSUM)

    def to_example(self, row: dict[str, Any], fallback_id: str) -> Example:
        example = {"id": fallback_id, "document": row["report"].strip(), "reference": row["summary"].strip()}
        example["prompt"] = self.build_prompt(example, example["document"])
        return example

    def build_prompt(self, example: Example, document: str) -> str:
        return f"{INSTRUCTION}\n\nReport:\n{document}\n\n{CLOSING}"

    def score(self, completion: str, example: Example) -> dict[str, float]:
        return rouge(self.prediction(completion), example["reference"])
