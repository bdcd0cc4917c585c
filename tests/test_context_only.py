"""The question outside the compressed span (`ContextOnly`): against a hand-written SnapKV over the context alone
(float64 softmax of the context's last queries, causal, padding hidden; protected sink and window; top votes), the
closing kept beyond the budget; and through the grid on the tiny model, the closing's keys never evicted."""

import math

import pytest
import torch

from smd_cli.attention.policy import PrefillView
from smd_cli.eviction.context_only import ContextOnly
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.evaluation.policy_grid import evaluate_grid
from smd_cli.rollout.sampler import generate
from smd_cli.tasks.ruler import Ruler


def hand_snapkv_context(query, key, real, closing, c, sink, window):
    """Kept columns per KV head of one row: SnapKV (kernel 1) over the real tokens before the closing, plus the closing."""
    width = key.shape[1]
    columns = [j for j in range(width - closing) if real[j]]
    n = len(columns)
    groups = query.shape[0] // key.shape[0]
    budget = max(math.ceil((1 - c) * n), sink + window)
    kept = []
    for h in range(key.shape[0]):
        votes = torch.zeros(n, dtype=torch.float64)
        for q in range(h * groups, (h + 1) * groups):
            for i in range(n - window, n):  # the context's last `window` queries, causal over the context
                logits = torch.tensor([float(query[q, columns[i]].double() @ key[h, columns[j]].double()) / math.sqrt(key.shape[-1])
                                       for j in range(i + 1)])
                votes[: i + 1] += torch.softmax(logits, dim=0) / groups
        protected = set(range(sink)) | set(range(n - window, n))
        ranked = sorted((i for i in range(n) if i not in protected), key=lambda i: -float(votes[i]))
        chosen = protected | set(ranked[: budget - len(protected)])
        kept.append(sorted(columns[i] for i in chosen) + list(range(width - closing, width)))
    return kept


def test_the_context_is_chosen_alone_and_the_closing_kept_beyond_the_budget():
    torch.manual_seed(0)
    rows, heads, kv_heads, width, dim = 3, 4, 2, 24, 8
    query, key = torch.randn(rows, heads, width, dim), torch.randn(rows, kv_heads, width, dim)
    real = torch.ones(rows, width, dtype=torch.bool)
    real[1, :3] = False  # a left-padded row
    closing = [5, 2, 5]
    policy = ContextOnly(SnapKV(0.5, sink=2, window=3, kernel=1), closing)
    lengths = real.sum(dim=1)
    budget = policy.budget(lengths)
    assert budget.tolist() == [math.ceil(0.5 * (int(p) - t)) + t for p, t in zip(lengths, closing)]
    chosen = policy.select_prefill(PrefillView(query, key, real, 1 / math.sqrt(dim), 0), budget)
    for r in range(rows):
        expected = hand_snapkv_context(query[r], key[r], real[r], closing[r], 0.5, 2, 3)
        for h in range(kv_heads):
            got = chosen.index[r, h][chosen.ok[r, h]].tolist()
            assert got == expected[h], (r, h)  # sorted by position, the padding after
            assert not chosen.ok[r, h, len(got):].any()


def test_a_closing_that_leaves_no_context_is_named():
    with pytest.raises(ValueError, match="leaves no context"):
        ContextOnly(SnapKV(0.5), [10]).budget(torch.tensor([10]))


def test_the_grid_never_evicts_the_question_outside_the_compressed_span(tiny_model, tiny_tokenizer):
    task = Ruler(family="niah_single", haystack="noise", prompt_tokens=480, max_new_tokens=3)
    examples = task.examples("test", limit=2)
    out = evaluate_grid(tiny_model, tiny_tokenizer, task, examples, {"inside": SnapKV(0.75), "outside": SnapKV(0.75)},
                        max_new_tokens=3, prompts_per_batch=2, outside=frozenset({"outside"}))
    assert set(out) == {"inside", "outside"} and all(len(r["rows"]) == 2 for r in out.values())
    prompts = [task.encode_prompt(e, tiny_tokenizer) for e in examples]
    closing = [task.closing_tokens(e, tiny_tokenizer) for e in examples]
    batch = generate(tiny_model, prompts, policy=ContextOnly(SnapKV(0.75), closing), max_new_tokens=2, temperature=0.0,
                     eos_token_id=-1, pad_token_id=tiny_tokenizer.pad_token_id, measure_dense_kv=False)
    width = max(map(len, prompts))
    for r, t in enumerate(closing):
        assert 100 < t < 200  # the question and the answer prefix: about 150 bytes of the tiny tokenizer
        kept = batch.evict_at[r] > width  # [L, Hkv, T]: not evicted at the prefill (which marks its evictions `width`)
        assert kept[:, :, width - t:width].all()  # every layer and head keeps the closing
        kept_context = kept[0, 0, :width - t].sum()
        assert int(kept_context) == math.ceil(0.25 * (len(prompts[r]) - t))
