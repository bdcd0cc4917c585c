"""The evaluation loop on the tiny model: batching keeps order, greedy is deterministic, eviction shrinks
the KV cache, and the summary is the task's metrics over the per-example rows."""

import json
import math

import pytest
import torch

from smd_cli.evaluation.batch import evaluate
from smd_cli.tasks.gsm8k import GSM8K

QUESTIONS = ["What is 2 + 2?", "A farmer has 12 cows and buys 30 more cows at the market. How many cows now?",
             "What is 3 * 5?", "Tom has 1,000 apples and eats 1 of them. How many are left?", "What is 9 - 4?"]


@pytest.fixture
def gsm8k_examples(tmp_path):
    answers = ["#### 4", "#### 42", "#### 15", "#### 999", "#### 5"]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(QUESTIONS, answers)))
    task = GSM8K(data_files=str(path), max_prompt_tokens=256)
    return task, task.examples("test")


def test_evaluate_dense_greedy(tiny_model, tiny_tokenizer, gsm8k_examples):
    task, examples = gsm8k_examples
    rows, summary = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=4, batch_size=2, progress=False)
    assert [r["id"] for r in rows] == [e["id"] for e in examples]  # sorted by length inside, restored outside
    assert all(0 < r["response_tokens"] <= 4 for r in rows)
    assert [r["prompt_tokens"] for r in rows] == [len(task.encode_prompt(e, tiny_tokenizer)) for e in examples]
    assert summary["n"] == 5 and summary["accuracy"] == sum(r["accuracy"] for r in rows) / 5
    assert summary["kv/bytes_peak"] > 0 and summary["kv/bytes_peak"] == summary["kv/bytes_peak_dense"]
    assert summary["memory/peak_rss_bytes"] > 0
    again, _ = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=4, batch_size=3, progress=False)
    assert [r["completion"] for r in again] == [r["completion"] for r in rows]  # greedy: batching-independent


def test_evaluate_with_eviction_sampled(tiny_model, tiny_tokenizer, gsm8k_examples):
    from smd_cli.eviction.snapkv import SnapKV

    task, examples = gsm8k_examples
    _, dense = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=4, batch_size=5, progress=False)
    rows, summary = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=4, batch_size=5,
                             policy=SnapKV(compression=0.5), temperature=1.0, seed=3, progress=False)
    assert summary["kv/bytes_peak"] < 0.75 * dense["kv/bytes_peak"]
    again, _ = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=4, batch_size=5,
                        policy=SnapKV(compression=0.5), temperature=1.0, seed=3, progress=False)
    assert [r["completion"] for r in again] == [r["completion"] for r in rows]  # seeded sampling


def test_evaluate_rejects_bad_input(tiny_model, tiny_tokenizer, gsm8k_examples):
    task, examples = gsm8k_examples
    with pytest.raises(ValueError, match="no examples"):
        evaluate(tiny_model, tiny_tokenizer, task, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="eval.batch_size must be >= 1, got 0"):
        evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=4, batch_size=0)


def test_kept_through_counts_never_evicted_keys_by_hand():
    from smd_cli.attention.shadow import kept_through

    T = 6
    evict_at = torch.full((2, 2, 2, T), T, dtype=torch.int32)  # [B, L, Hkv, T]: nothing evicted
    evict_at[0, 0, 0, 1] = 4  # row 0, layer 0, head 0 loses column 1 at query 4
    evict_at[0, 1, :, 2] = 3  # row 0, layer 1, both heads lose column 2
    evict_at[1, 0, 1, 3] = 5  # row 1, layer 0, head 1 loses column 3
    # named keys: row 0 columns 1 and 2, row 1 column 3 -> 3 keys x 2 heads = 6 entries per layer
    kept = kept_through(evict_at, [[1, 2], [3]])
    assert kept.tolist() == pytest.approx([4 / 6, 4 / 6])  # layer 0 loses (0,h0,1) and (1,h1,3); layer 1 both heads of (0,2)
    assert kept_through(evict_at, [[], []]).isnan().all()


def test_evaluation_under_eviction_reports_the_answer_evidence_kept(tiny_model, tiny_tokenizer):
    from smd_cli.eviction.recent import Recent
    from smd_cli.tasks.synthetic import MajorityVote

    task = MajorityVote(prompt_tokens=48)
    examples = task.examples("test", limit=6)
    policy = Recent(compression=0.5, sink=0, window=4)  # keeps the newest ceil(0.5 * 49) = 25 prompt tokens, every layer and head
    _, summary = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=3, batch_size=4, policy=policy)
    # by hand: a marked value survives iff it is among the last 25 prompt positions (bos + 48 words)
    ids = [task.encode_prompt(e, tiny_tokenizer) for e in examples]
    kept = [p >= len(i) - 25 for e, i in zip(examples, ids) for p in task.evidence_positions(e, i)]
    assert 0 < sum(kept) < len(kept)  # some marks in the kept window, some not
    assert summary["evidence/kept_l0"] == pytest.approx(sum(kept) / len(kept)) == summary["evidence/kept_l1"]
    _, dense = evaluate(tiny_model, tiny_tokenizer, task, examples, max_new_tokens=3)
    assert "evidence/kept" not in dense


def test_exact_match_is_the_fraction_of_whole_answers_beside_the_partial_credit_reward():
    """Passkey credits digits in place: the full key 1, four of five digits 0.8, none 0. Exact match counts only the
    first (by hand: reward (1 + 0.8 + 0) / 3, exact 1 / 3, each with the sample standard error)."""
    from smd_cli.tasks.passkey import Passkey

    task = Passkey(prompt_tokens=40)
    examples = task.examples("test", limit=3)
    keys = [e["key"] for e in examples]
    got = task.metrics([f"The key is {keys[0]}.", keys[1][:4], "no idea"], examples)
    assert got["reward"] == pytest.approx(1.8 / 3) and got["exact"] == pytest.approx(1 / 3)
    assert got["exact_stderr"] == pytest.approx(math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2 / 3))
