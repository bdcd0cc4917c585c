"""Per-example evaluation metrics of the paper's four tasks: pure functions of (prediction, reference).

- GSM8K accuracy: the official extraction (`#### N`, commas removed, exact compare) with the
  fallbacks of lm-evaluation-harness's flexible match: `\\boxed{N}`, then the last number.
- ROUGE-L / ROUGE-Lsum F1 (TL;DR, GovReport): Google's `rouge-score` with the Porter stemmer, one score
  per example; averaging is ours (its bootstrap aggregator is unseeded). `rougeLsum` splits sentences on
  newlines, as `rouge-score` does. `evaluate.load("rouge")` is never used: it fetches a script from the Hub.
- HotpotQA EM and token F1: the official `hotpot_evaluate_v1.py` normalisation and its yes/no/noanswer rule.

Each metric is a `Metric` that declares `higher_is_better` and how it aggregates over examples
(lm-evaluation-harness style), so stages can rank and summarise results without knowing the task.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache


@dataclass(frozen=True)
class Metric:
    """A per-example score with its direction; aggregated over examples by the mean (and its stderr)."""

    name: str
    fn: Callable[[str, str], float]
    higher_is_better: bool = True
    aggregation: str = "mean"

    def __call__(self, prediction: str, reference: str) -> float:
        return self.fn(prediction, reference)


# ----------------------------------------------------------------------------------------- GSM8K

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,080 as one number; "3, 4" as two
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + r"|-?\.\d+)")
_ANY_NUMBER = re.compile(_NUMBER)


def canonical_number(text: str) -> str | None:
    """`"$1,080.00."` -> `"1080"`: drop `$`, commas, a trailing period and trailing decimal zeros. Exact for a number
    of any length (no rounding to a context's precision: `1...1.5` with 28 ones stays itself)."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    sign, digits, exponent = value.as_tuple()
    digits = list(digits)
    while exponent < 0 and len(digits) > 1 and digits[-1] == 0:  # trailing decimal zeros, dropped without arithmetic
        digits.pop()
        exponent += 1
    if exponent < 0 and digits == [0]:
        exponent = 0
    return format(Decimal((sign, tuple(digits), exponent)), "f")  # formatting never rounds


def _boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (and `\\fbox{...}`), with nested braces balanced."""
    out = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[start:i])
                break
    return out


def extract_gsm8k_answer(text: str) -> str | None:
    """The final numeric answer of a GSM8K solution, canonicalised, or None when there is none.

    Order: the last `#### N` (the dataset's own format, which our prompt asks for), else the last
    `\\boxed{...}` holding a number, else the last number anywhere in the text.
    """
    hashes = _HASH_ANSWER.findall(text)
    if hashes:
        return canonical_number(hashes[-1])
    for box in reversed(_boxed_contents(text)):
        numbers = _ANY_NUMBER.findall(box.replace("\\$", "").replace("\\!", ""))
        if numbers:
            return canonical_number(numbers[-1])
    numbers = _ANY_NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


def gsm8k_accuracy(prediction: str, reference: str) -> float:
    """1.0 when the prediction's final answer equals the reference's (a gold solution or a bare number)."""
    gold = extract_gsm8k_answer(reference)
    if gold is None:
        raise ValueError(f"GSM8K reference holds no number: {reference[-80:]!r}")
    return float(extract_gsm8k_answer(prediction) == gold)


def gsm8k_accuracy_math_verify(prediction: str, reference: str) -> float:
    """GSM8K accuracy judged by Hugging Face's `math-verify` (optional extra): gold = our extraction."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("task.math_verify=true needs the `math-verify` package: pip install math-verify") from err
    gold = extract_gsm8k_answer(reference)
    if gold is None:
        raise ValueError(f"GSM8K reference holds no number: {reference[-80:]!r}")
    return float(verify(parse(gold), parse(prediction)))


# ----------------------------------------------------------------------------------------- ROUGE


@lru_cache(maxsize=4)
def _rouge_scorer(kinds: tuple[str, ...]):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)


def rouge(prediction: str, reference: str, kinds: tuple[str, ...] = ("rougeL", "rougeLsum")) -> dict[str, float]:
    """ROUGE F1 of one prediction against one reference (`RougeScorer.score(target, prediction)`).

    `kinds` lets a reward compute only `rougeL` (the summary-level LCS of `rougeLsum` costs as much again).
    """
    scores = _rouge_scorer(tuple(kinds)).score(reference, prediction)
    return {kind: scores[kind].fmeasure for kind in kinds}


def rouge_l(prediction: str, reference: str) -> float:
    return rouge(prediction, reference, ("rougeL",))["rougeL"]


def rouge_lsum(prediction: str, reference: str) -> float:
    return rouge(prediction, reference, ("rougeLsum",))["rougeLsum"]


# -------------------------------------------------------------------------------------- HotpotQA

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_SPECIAL_ANSWERS = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """HotpotQA/SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def hotpot_em(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def hotpot_f1(prediction: str, reference: str) -> float:
    """Token F1 after normalisation; 0 when either side is yes/no/noanswer and the two differ.

    One departure from `hotpot_evaluate_v1.py`: when a side normalises to no tokens (the dev answers
    "The The" and "!!!" do), F1 is 1 if both are empty and 0 otherwise, as in SQuAD 2.0's evaluation;
    the HotpotQA script would score gold against itself F1 = 0 there while EM = 1.
    """
    pred, gold = normalize_answer(prediction), normalize_answer(reference)
    if (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS) and pred != gold:
        return 0.0
    if not pred or not gold:
        return float(pred == gold)
    common = Counter(pred.split()) & Counter(gold.split())
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred.split()), overlap / len(gold.split())
    return 2 * precision * recall / (precision + recall)


GSM8K_ACCURACY = Metric("accuracy", gsm8k_accuracy)
GSM8K_ACCURACY_MATH_VERIFY = Metric("accuracy", gsm8k_accuracy_math_verify)
ROUGE_L = Metric("rougeL", rouge_l)
ROUGE_LSUM = Metric("rougeLsum", rouge_lsum)
HOTPOT_EM = Metric("em", hotpot_em)
HOTPOT_F1 = Metric("f1", hotpot_f1)
