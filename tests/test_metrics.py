"""Metric functions on hand-computed examples (GSM8K extraction, ROUGE-L/Lsum, HotpotQA EM/F1)."""

import pytest

from smd_cli.tasks import metrics
from smd_cli.tasks.metrics import (
    canonical_number,
    extract_gsm8k_answer,
    gsm8k_accuracy,
    hotpot_em,
    hotpot_f1,
    normalize_answer,
    rouge,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 1,000 + 80 = 1,080 apples.\n#### 1,080", "1080"),  # comma inside the final answer
        ("#### $18", "18"),  # dollar sign
        ("#### 18.", "18"),  # trailing period
        ("#### -7", "-7"),
        ("#### 2.50", "2.5"),
        ("First 3 then 5.\n#### 12\nCheck: 4 + 8 = 12, not 13", "12"),  # `####` wins over the last number
        ("So the answer is \\boxed{18}.", "18"),
        ("\\boxed{\\$1,080.00} dollars, then 7", "1080"),  # boxed wins over the last number
        ("\\boxed{\\frac{3}{4}} or \\boxed{42}", "42"),  # the last box holding a number
        ("The total is 1,080.", "1080"),  # last-number fallback, comma and period
        ("I ate 3, 4 apples", "4"),  # "3, 4" is two numbers, not 34
        ("no number here", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_canonical_number():
    assert canonical_number("$1,080.00.") == "1080"
    assert canonical_number("0.50") == "0.5"
    assert canonical_number("abc") is None


def test_gsm8k_accuracy():
    gold = "Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18"
    assert gsm8k_accuracy("9 * 2 = 18 dollars\n#### $18.", gold) == 1.0
    assert gsm8k_accuracy("The answer is \\boxed{18}", gold) == 1.0
    assert gsm8k_accuracy("#### 17", gold) == 0.0
    assert gsm8k_accuracy("I do not know", gold) == 0.0
    assert gsm8k_accuracy("1,080 apples", "1080") == 1.0  # a bare-number reference
    with pytest.raises(ValueError, match="reference holds no number"):
        gsm8k_accuracy("18", "#### eighteen")


def test_rouge_hand_examples():
    # LCS of "the cat sat on the mat" / "the cat was on the mat" = 5 of 6 tokens each: F1 = 5/6.
    assert rouge("the cat sat on the mat", "the cat was on the mat")["rougeL"] == pytest.approx(5 / 6)
    # Swapped sentences: one LCS of 3 of 6 tokens (F1 0.5), but per-sentence (newline) LCS unions cover all.
    scores = rouge("the dog ran\nthe cat sat", "the cat sat\nthe dog ran")
    assert scores["rougeL"] == pytest.approx(0.5)
    assert scores["rougeLsum"] == pytest.approx(1.0)
    # Porter stemming: "cats running" matches "cat run".
    assert rouge("cats running", "cat run")["rougeL"] == pytest.approx(1.0)
    assert rouge("", "the cat")["rougeL"] == 0.0
    assert metrics.rouge_l("a b c", "a b c") == metrics.rouge_lsum("a b c", "a b c") == 1.0


def test_hotpot_normalisation_em_f1():
    assert normalize_answer("The  Eiffel   Tower!") == "eiffel tower"
    assert normalize_answer("an Apple, a Day") == "apple day"
    assert hotpot_em("the Eiffel tower.", "Eiffel Tower") == 1.0
    assert hotpot_em("Eiffel", "Eiffel Tower") == 0.0
    # precision 2/3, recall 1: F1 = 0.8
    assert hotpot_f1("Barack Obama president", "Barack Obama") == pytest.approx(0.8)
    assert hotpot_f1("Paris", "London") == 0.0


def test_hotpot_yes_no_rule():
    assert hotpot_f1("yes", "no") == 0.0
    assert hotpot_f1("Yes.", "yes") == 1.0
    # Without the rule "yes it is" vs "yes" would get F1 = 0.5; with it, 0.
    assert hotpot_f1("yes it is", "yes") == 0.0
    assert hotpot_f1("no", "no answer at all") == 0.0
    assert hotpot_f1("noanswer", "something") == 0.0
    # Answers that normalise to nothing ("The The", "!!!") score 1 against themselves, 0 otherwise.
    assert hotpot_f1("The The", "The The") == 1.0
    assert hotpot_f1("!!!", "The Who") == 0.0


def test_metrics_declare_direction():
    specs = [metrics.GSM8K_ACCURACY, metrics.ROUGE_L, metrics.ROUGE_LSUM, metrics.HOTPOT_EM, metrics.HOTPOT_F1]
    assert [m.name for m in specs] == ["accuracy", "rougeL", "rougeLsum", "em", "f1"]
    assert all(m.higher_is_better and m.aggregation == "mean" for m in specs)
    assert metrics.HOTPOT_F1("the answer", "answer") == 1.0


def test_gsm8k_math_verify_option():
    pytest.importorskip("math_verify")
    from smd_cli.tasks.metrics import gsm8k_accuracy_math_verify

    assert gsm8k_accuracy_math_verify("so \\boxed{1,080}", "#### 1,080") == 1.0
    assert gsm8k_accuracy_math_verify("The answer is $18.", "#### 18") == 1.0
    assert gsm8k_accuracy_math_verify("#### 17", "#### 18") == 0.0
    from smd_cli.tasks.gsm8k import GSM8K

    task = GSM8K(math_verify=True)
    assert task.reward("\\boxed{18}", {"reference": "18"}) == 1.0 and task.primary_metric.name == "accuracy"


def test_numbers_of_any_length_are_compared_exactly_and_never_raise():
    """Issue 40's probe: a number of 29+ digits raised decimal.InvalidOperation (`quantize` at the default 28-digit
    precision), and 28 digits and a half were rounded to the next integer. The canonical forms are written by hand."""
    big = "1" * 29
    assert canonical_number(big) == big
    assert canonical_number(f"{'9' * 40}.000") == "9" * 40
    assert canonical_number(f"{'1' * 28}.5") == f"{'1' * 28}.5"  # not rounded to ...112
    assert canonical_number("-0.0") == "-0" and canonical_number("1.50") == "1.5"
    assert gsm8k_accuracy(f"#### {big}", f"#### {big}") == 1.0
    assert gsm8k_accuracy(f"so {'1' * 28}.5", f"#### {'1' * 27}2") == 0.0  # reward 0, and no exception
    assert gsm8k_accuracy(f"#### {'7' * 5000}", "#### 18") == 0.0
