"""The tiny scale's tokenizer and synthetic tasks: deterministic, one token per word, a verifiable reward."""

import pytest

from smd_cli.model.build import tiny_words
from smd_cli.tasks.synthetic import MajorityVote, MultiNeedleRetrieval, NeedleRetrieval


def test_tokenizer_round_trips_text_and_keeps_task_words_whole(tiny_tokenizer):
    text = "Natalia sold 1,080 clips in April.\n#### $18 \\boxed{72}"
    assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text
    words = tiny_words()
    ids = tiny_tokenizer(" " + " ".join(words), add_special_tokens=False)["input_ids"]
    assert len(ids) == len(words) == 128 + 64 + 64 + 5
    assert len(tiny_tokenizer) == 541 and tiny_tokenizer.padding_side == "left"
    assert (tiny_tokenizer.pad_token_id, tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id) == (0, 1, 2)


def test_needle_prompt_layout_and_determinism(tiny_tokenizer):
    task = NeedleRetrieval(prompt_tokens=64)
    ex = task.example("train", 5)
    assert ex == NeedleRetrieval(prompt_tokens=64).example("train", 5)  # a pure function of (seed, split, index)
    assert ex != task.example("test", 5) and ex != NeedleRetrieval(prompt_tokens=64, seed=1).example("train", 5)
    words = ex["prompt"].split()
    assert len(words) == 64 and words[-1] == "QUERY" and words.count("NEEDLE") == 1
    value = words[words.index("NEEDLE") + 1]
    assert ex["reference"] == f" ANSWER {value}"
    assert len(task.encode_prompt(ex, tiny_tokenizer)) == 65  # bos + one token per word


def test_multi_needle_queries_one_of_its_keys():
    task = MultiNeedleRetrieval(prompt_tokens=80, num_needles=3, value_tokens=2)
    ex = task.example("test", 0)
    words = ex["prompt"].split()
    assert len(words) == 80 and words[-2] == "QUERY" and words.count("NEEDLE") == 3
    at = [i for i, w in enumerate(words) if w == "NEEDLE" and words[i + 1] == words[-1]]
    assert len(at) == 1 and ex["reference"].split() == ["ANSWER", *words[at[0] + 2 : at[0] + 4]]
    assert ex["needle_offsets"] == sorted(ex["needle_offsets"])


@pytest.mark.parametrize(
    "completion, reward",
    [(" ANSWER v1 v2", 1.0), (" ANSWER v1 v9", 0.5), (" ANSWER v9 v2", 0.5), (" ANSWER v1", 0.5),
     (" ANSWER v1 v2 v3", 2 / 3), (" v1 v2", 0.0), ("", 0.0), (" ANSWER", 0.0)],
)
def test_reward_by_hand(completion, reward):
    task = MultiNeedleRetrieval(prompt_tokens=64, num_needles=2, value_tokens=2)
    assert task.reward(completion, {"reference": " ANSWER v1 v2"}) == pytest.approx(reward)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"num_needles": 0}, "task.num_needles=0"), ({"value_tokens": 0}, "task.value_tokens=0"),
     ({"prompt_tokens": 10, "num_needles": 4}, "task.prompt_tokens=10: too short"), ({"num_keys": 500}, "task.num_keys=500")],
)
def test_bad_task_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiNeedleRetrieval(**kwargs)
    with pytest.raises(ValueError, match="split='dev'"):
        NeedleRetrieval().example("dev", 0)


def test_majority_vote_layout_and_evidence_positions(tiny_tokenizer):
    task = MajorityVote(prompt_tokens=64, num_marks=5, majority=3)
    ex = task.example("test", 7)
    assert ex == MajorityVote(prompt_tokens=64).example("test", 7)  # a pure function of (seed, split, index)
    words = ex["prompt"].split()
    assert len(words) == 64 and words[-1] == "QUERY" and words.count("NEEDLE") == 5
    marked = [words[i + 1] for i, w in enumerate(words) if w == "NEEDLE"]
    counts = {v: marked.count(v) for v in marked}
    (answer, top), = [(v, c) for v, c in counts.items() if c == max(counts.values())]
    assert top == 3 and sorted(counts.values()) == [1, 1, 3] and ex["reference"] == f" ANSWER {answer}"
    ids = task.encode_prompt(ex, tiny_tokenizer)
    positions = task.evidence_positions(ex, ids)
    assert len(positions) == 3 and [tiny_tokenizer.decode([ids[p]]) for p in positions] == [f" {answer}"] * 3
    assert all(tiny_tokenizer.decode([ids[p - 1]]) == " NEEDLE" for p in positions)


def test_evidence_positions_of_the_retrieval_tasks(tiny_tokenizer):
    needle = NeedleRetrieval(prompt_tokens=40)
    ex = needle.example("train", 3)
    ids = needle.encode_prompt(ex, tiny_tokenizer)
    assert [tiny_tokenizer.decode([ids[p]]).strip() for p in needle.evidence_positions(ex, ids)] == ex["reference"].split()[1:]
    multi = MultiNeedleRetrieval(prompt_tokens=60, num_needles=3, value_tokens=2)
    ex = multi.example("train", 3)
    ids = multi.encode_prompt(ex, tiny_tokenizer)
    key, values = ex["prompt"].split()[-1], ex["reference"].split()[1:]
    assert [tiny_tokenizer.decode([ids[p]]).strip() for p in multi.evidence_positions(ex, ids)] == [key, *values]


@pytest.mark.parametrize("kwargs, message", [({"num_marks": 4, "majority": 2}, "strict majority"),
                                             ({"num_marks": 5, "majority": 6}, "strict majority"),
                                             ({"prompt_tokens": 16}, "too short for 5 marks")])
def test_bad_vote_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MajorityVote(**kwargs)
