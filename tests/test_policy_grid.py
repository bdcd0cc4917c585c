"""One prefill, many evictions (`smd_cli.evaluation.policy_grid`): a batch of prompts x policies, each prompt prefilled
once, keeps per row exactly what its policy keeps alone (the shadow mask, prefill and decode-time evictions alike)
and scores the same tokens; the grid's summaries are the task's metrics per policy. Tiny model, about 2 s."""

import pytest
import torch

from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.knorm import KNorm
from smd_cli.eviction.none import KeepAll
from smd_cli.eviction.recent import Recent
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.evaluation.policy_grid import PerRow, evaluate_grid
from smd_cli.rollout.sampler import generate
from smd_cli.tasks.ruler import Ruler


def test_each_row_keeps_what_its_policy_keeps_alone(tiny_model, tiny_tokenizer):
    task = Ruler(family="niah_multikey", haystack="needle", prompt_tokens=480, max_new_tokens=6)
    prompts = [task.encode_prompt(e, tiny_tokenizer) for e in task.examples("test", limit=2)]
    policies = [KeepAll(), SnapKV(0.5), H2O(0.5), Recent(0.75), KNorm(0.5)]
    rows = [p for p in prompts for _ in policies]
    assignment = [j for _ in prompts for j in range(len(policies))]
    common = dict(max_new_tokens=6, temperature=0.0, eos_token_id=-1, pad_token_id=tiny_tokenizer.pad_token_id, measure_dense_kv=False)
    grid = generate(tiny_model, rows, policy=PerRow(policies, assignment), **common)
    for j, policy in enumerate(policies):
        alone = generate(tiny_model, prompts, policy=policy, **common)
        mine = [r for r, a in enumerate(assignment) if a == j]
        assert torch.equal(grid.evict_at[mine], alone.evict_at), policy  # the same prefill and decode-time evictions
        assert torch.equal(grid.input_ids[mine], alone.input_ids)
        assert torch.allclose(grid.logprobs[mine], alone.logprobs, atol=1e-5)


def test_the_grid_reports_each_policys_metrics_and_retention(tiny_model, tiny_tokenizer):
    task = Ruler(family="niah_single", haystack="noise", prompt_tokens=480, max_new_tokens=4)
    examples = task.examples("test", limit=3)
    out = evaluate_grid(tiny_model, tiny_tokenizer, task, examples, {"dense": None, "recent": Recent(0.9)}, max_new_tokens=4,
                        prompts_per_batch=2)
    assert [r["id"] for r in out["dense"]["rows"]] == [e["id"] for e in examples]
    assert out["dense"]["summary"]["evidence/kept"] == 1.0  # a dense cache keeps every answer-bearing key
    assert out["recent"]["summary"]["evidence/kept"] < 0.5  # the newest 10 % rarely hold the needle
    assert {"reward", "ruler", "exact"} <= set(out["recent"]["summary"])


def test_a_bad_assignment_is_named():
    with pytest.raises(ValueError, match="names a policy outside 0..1"):
        PerRow([KeepAll(), Recent(0.5)], [0, 2])
