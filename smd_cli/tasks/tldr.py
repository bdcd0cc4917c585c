"""Reddit TL;DR (Stiennon et al. 2020; Hub `trl-lib/tldr`, fields `prompt`/`completion`): reward = ROUGE-L F1.

The Hub prompt is the OpenAI format `SUBREDDIT: r/...\\n\\nTITLE: ...\\n\\nPOST: ...\\n\\nTL;DR:`. For an
instruct model it is wrapped in an instruction; its trailing `TL;DR:` cue is moved after the post so that
truncation (which cuts the end of the post) keeps both the instruction and the cue.
"""

from __future__ import annotations

from typing import Any, ClassVar

from smd_cli.tasks.base import Example
from smd_cli.tasks.datafiles import FieldTypes
from smd_cli.tasks.loading import HubTask
from smd_cli.tasks.metrics import ROUGE_L, ROUGE_LSUM, rouge

INSTRUCTION = "Summarize the following Reddit post in one short sentence."
CUE = "TL;DR:"


class TLDR(HubTask):
    """TL;DR: splits train (116,722) / validation (6,447) / test (6,553)."""

    name = "tldr"
    hub_id = "trl-lib/tldr"
    hub_config = None
    splits = ("train", "validation", "test")
    train_split, test_split = "train", "test"
    field_types: ClassVar[FieldTypes] = {"prompt": str, "completion": str}
    metric_list = (ROUGE_L, ROUGE_LSUM)

    def to_example(self, row: dict[str, Any], fallback_id: str) -> Example:
        post = row["prompt"].rstrip()
        post = post[: -len(CUE)].rstrip() if post.endswith(CUE) else post
        example = {"id": fallback_id, "document": post, "reference": row["completion"].strip()}
        example["prompt"] = self.build_prompt(example, post)
        return example

    def build_prompt(self, example: Example, document: str) -> str:
        return f"{INSTRUCTION}\n\n{document}\n\n{CUE}"

    def score(self, completion: str, example: Example) -> dict[str, float]:
        return rouge(self.prediction(completion), example["reference"])
