"""task=ruler: each family's generator against hand-made expectations (the prompt at its length in tokens, the answers
in it at the recorded evidence positions, RULER's counts and templates, the same example from the same (seed, split,
index)), RULER's scoring on hand-written completions, and one `smd train` + `smd eval` on a family through the CLI.
The tiny byte-level tokenizer (about one token a character) stands in for a model's; about 10 s in all."""

import json
import math
import re
from collections import Counter

import pytest

from smd_cli.tasks import ruler_families
from smd_cli.tasks.ruler import Ruler, ruler_match_all
from tests.conftest import smd

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CASES = [("niah_single", "essay"), ("niah_single", "noise"), ("niah_multikey", "essay"), ("niah_multikey", "needle"),
         ("niah_multivalue", "essay"), ("niah_multiquery", "noise"), ("vt", "noise"), ("cwe", None), ("fwe", None)]
LENGTH = 2400  # tokens of the byte-level tokenizer: room for vt's worked example and the haystack around the needles


def built(tokenizer, family, haystack=None, index=0, split="test", **kw):
    task = Ruler(family=family, haystack=haystack, prompt_tokens=kw.pop("prompt_tokens", LENGTH), max_new_tokens=48, **kw)
    example = task.example(split, index)
    text, ids = task.fit_prompt(example, tokenizer)
    return task, example, text, ids


@pytest.mark.parametrize("family, haystack", CASES)
def test_the_prompt_has_its_length_and_the_answers_sit_at_the_evidence(tiny_tokenizer, family, haystack):
    task, example, text, ids = built(tiny_tokenizer, family, haystack)
    if family in ("cwe", "fwe"):  # a word list: the longest that fits, within one item of the request
        assert LENGTH - 12 <= len(ids) <= LENGTH
    else:  # a haystack: filled exactly, the last filler unit cut in tokens
        assert len(ids) == LENGTH
    evidence = task.evidence_positions(example, ids)
    assert evidence == sorted(set(evidence)) and evidence and max(evidence) < len(ids)
    kept = tiny_tokenizer.decode([ids[i] for i in evidence])
    for answer in example["answers"]:
        assert answer in kept and answer in text  # every answer is in the prompt, at the recorded positions
    if family.startswith("niah"):  # the evidence is the queried values and nothing else
        assert re.sub(r"\s", "", kept) == "".join(v for _, v in sorted(
            ((text.index(a), a) for a in example["answers"])))
        for distractor in example["distractors"][:8]:
            assert distractor not in kept


def test_evidence_is_known_only_for_the_prompts_the_task_built(tiny_tokenizer):
    task, example, _, ids = built(tiny_tokenizer, "niah_single", "noise", prompt_tokens=400)
    assert task.evidence_positions(example, list(ids)) == task.evidence_positions(example, tuple(ids))
    with pytest.raises(ValueError, match=f"{example['id']}: these prompt ids were not made by this task's encode_prompt"):
        task.evidence_positions(example, ids[:-1])  # one token short: not a prompt this task made
    task._evidence.size = 2  # the memo keeps the last `size` prompts: a third evicts the first
    others = [built(tiny_tokenizer, "niah_single", "noise", index=i, prompt_tokens=400)[1:4:2] for i in (1, 2)]
    for other, other_ids in others:
        task.fit_prompt(other, tiny_tokenizer)
    with pytest.raises(ValueError):
        task.evidence_positions(example, ids)
    assert task.evidence_positions(*others[-1])


def test_the_needle_haystack_is_made_of_distractor_needles_and_multikey_asks_one_of_four_keys(tiny_tokenizer):
    _, example, text, _ = built(tiny_tokenizer, "niah_multikey", "needle")
    lines = text.split("\n")
    needles = [line for line in lines if line.startswith("One of the special magic numbers for ")]
    assert len(needles) > 10 and len(example["answers"]) == 1  # RULER's niah_multikey_2: one real key among needles
    assert sum(example["answers"][0] in line for line in needles) == 1
    _, example, text, _ = built(tiny_tokenizer, "niah_multikey", "essay")
    assert text.count("One of the special magic numbers for ") == 4 and len(example["distractors"]) == 3
    assert len(example["draw"]["keys"]) == 4 and example["draw"]["queried"][0] in example["draw"]["keys"]


def test_the_templates_are_rulers_singular_for_one_value_plural_for_several(tiny_tokenizer):
    task, example, text, ids = built(tiny_tokenizer, "niah_single", "noise")
    key = example["draw"]["queried"][0]
    assert text.startswith("A special magic number is hidden within the following text. Make sure to memorize it. "
                           "I will quiz you about the number afterwards.\nThe grass is green.")
    assert text.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text?")
    assert tiny_tokenizer.decode(ids).endswith(f" The special magic number for {key} mentioned in the provided text is")
    task, example, text, ids = built(tiny_tokenizer, "niah_multiquery", "essay")
    keys = example["draw"]["queried"]
    assert len(keys) == 4 and len(example["answers"]) == 4
    assert text.startswith("Some special magic numbers are hidden within the following text.")
    assert text.endswith(f"What are all the special magic numbers for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} "
                         "mentioned in the provided text?")


def test_variable_tracking_hides_a_chain_in_order_after_a_worked_example(tiny_tokenizer):
    _, example, text, ids = built(tiny_tokenizer, "vt")
    chain, value = example["draw"]["chains"][0], example["draw"]["values"][0]
    assert example["answers"] == chain and len(chain) == 5  # 4 hops: 5 variables
    main = text[text.rindex("Memorize and track"):]
    lines = [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(chain, chain[1:])]
    positions = [main.index(line) for line in lines]
    assert positions == sorted(positions)
    shot = text[: text.rindex("Memorize and track")]
    assert shot.startswith("Memorize and track") and shot.endswith(" ".join(example["draw"]["shot"]["variables"]) + "\n")
    assert tiny_tokenizer.decode(ids).endswith(f"5 variables are assigned the value {value}, they are: ")


def test_common_words_repeat_six_times_and_the_rest_once(tiny_tokenizer):
    task, example, text, ids = built(tiny_tokenizer, "cwe")
    listing = text[text.rindex("Below is a numbered list"):]
    words = re.findall(r"\d+\. ([a-z]+)", listing.split("\nQuestion")[0])
    counts = Counter(words)
    assert {counts[w] for w in example["answers"]} == {6}  # RULER below 4k tokens: x6 and x1
    assert set(counts) - set(example["answers"]) and {c for w, c in counts.items() if w not in example["answers"]} == {1}
    assert [int(n) for n in re.findall(r"(\d+)\. ", listing.split("\nQuestion")[0])] == list(range(1, len(words) + 1))
    kept = tiny_tokenizer.decode([ids[i] for i in task.evidence_positions(example, ids)]).split()
    assert Counter(kept) == Counter({w: 6 for w in example["answers"]})


def test_frequent_words_follow_zipf_with_the_noise_word_first(tiny_tokenizer):
    _, example, text, _ = built(tiny_tokenizer, "fwe")
    context = text.split("coded words. ", 1)[1].split("\nQuestion")[0].split()
    counts = Counter(context)
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == example["answers"]
    assert math.isclose(ruler_families._zeta(2.0), math.pi**2 / 6, rel_tol=1e-12)
    top = counts["..."]  # int(n / zeta(2)); the k-th word int(n / (k^2 zeta(2)))
    for k, word in enumerate(ranked[1:4], start=2):
        assert abs(counts[word] - top / k**2) <= 1


@pytest.mark.parametrize("family, haystack", [("niah_multikey", "needle"), ("vt", None), ("cwe", None)])
def test_an_example_is_a_function_of_seed_split_and_index(tiny_tokenizer, family, haystack):
    _, a, _, ids_a = built(tiny_tokenizer, family, haystack, index=3)
    _, b, _, ids_b = built(tiny_tokenizer, family, haystack, index=3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and ids_a == ids_b
    others = [built(tiny_tokenizer, family, haystack, index=4)[1], built(tiny_tokenizer, family, haystack, index=3, split="train")[1],
              built(tiny_tokenizer, family, haystack, index=3, seed=1)[1]]
    assert all(o["answers"] != a["answers"] for o in others)


def test_the_chat_template_wraps_the_user_message_and_the_answer_prefix_opens_the_reply(tiny_tokenizer):
    from smd_cli.model.build import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()  # a fresh copy, given a ChatML template as an instruct model's
    tokenizer.chat_template = CHATML
    _, example, _, ids = built(tokenizer, "niah_single", "noise", prompt_tokens=700)
    key = example["draw"]["queried"][0]
    prompt = tokenizer.decode(ids)
    assert len(ids) == 700 and prompt.startswith("<|im_start|>user\nA special magic number is hidden")
    assert prompt.endswith(f"<|im_end|>\n<|im_start|>assistant\nThe special magic number for {key} mentioned in the provided text is")
    _, _, _, raw = built(tokenizer, "niah_single", "noise", prompt_tokens=700, chat_template=False)
    assert raw[0] == tokenizer.bos_token_id and "<|im_start|>" not in tokenizer.decode(raw)


def test_the_closing_is_the_question_the_template_end_and_the_answer_prefix(tiny_tokenizer):
    """What kvpress appends after compressing the context: everything after the haystack's last filler."""
    from smd_cli.model.build import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHATML
    task, example, _, ids = built(tokenizer, "niah_single", "noise", prompt_tokens=700)
    key = example["draw"]["queried"][0]
    closing = tokenizer.decode(ids[len(ids) - task.closing_tokens(example, tokenizer):])
    assert closing == (f"\nWhat is the special magic number for {key} mentioned in the provided text?<|im_end|>\n"
                       f"<|im_start|>assistant\nThe special magic number for {key} mentioned in the provided text is")


def test_rulers_string_match_all_and_the_graded_reward_on_hand_written_completions(tiny_tokenizer):
    task = Ruler(family="niah_multivalue", prompt_tokens=LENGTH, max_new_tokens=48)
    example = {"answers": ["1234567", "2345678", "3456789", "4567890"], "distractors": ["9999999", "8888888"]}
    cases = {  # completion: (reward, ruler, exact)
        " 1234567, 2345678, 3456789, and 4567890.": (1.0, 1.0, 1.0),
        " 1234567 and 2345678.": (0.5, 0.5, 0.0),
        " 1234567, 2345678, 3456789, 4567890, 9999999 and 8888888.": (4 / 6, 1.0, 0.0),  # distractors named cost
        " 123456, 2345678.": (0.25, 0.25, 0.0),  # a near miss scores nothing (RULER's rule)
        " none of them": (0.0, 0.0, 0.0),
    }
    for completion, (reward, ruler, exact) in cases.items():
        assert task.score(completion, example) == pytest.approx({"reward": reward, "ruler": ruler, "exact": exact}), completion
    assert ruler_match_all(list(cases), [example["answers"]] * len(cases)) == round(100 * (1 + 0.5 + 1 + 0.25 + 0) / 5, 2)
    assert ruler_match_all([" The answer: ABCDE fghij"], [["abcde", "FGHIJ", "KLMNO"]]) == 66.67  # case-insensitive
    summary = task.metrics(list(cases), [example] * len(cases))
    assert summary["ruler"] == pytest.approx(0.55) and summary["exact"] == pytest.approx(0.2)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="task.haystack='needle' is not allowed with task.family=niah_single: essay, noise"):
        Ruler(family="niah_single", haystack="needle")
    with pytest.raises(ValueError, match="task.num_hops=3 is not allowed with task.family=niah_single"):
        Ruler(family="niah_single", num_hops=3)
    with pytest.raises(ValueError, match="task.family='qa'"):
        Ruler(family="qa")


def test_a_prompt_too_short_for_its_instructions_is_named(tiny_tokenizer):
    with pytest.raises(ValueError, match="task.prompt_tokens=200 is too short for task.family=vt"):
        built(tiny_tokenizer, "vt", prompt_tokens=200)


def test_train_and_eval_run_a_family_through_the_cli(tmp_path):
    common = ["task=ruler", "task.family=niah_single", "task.haystack=noise", "task.prompt_tokens=420", "task.max_new_tokens=8",
              "progress=false", f"cache_dir={tmp_path / 'cache'}"]
    assert smd("train", *common, "steps=1", "grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=2",
               "model.warmstart.steps=1", "eviction=snapkv", "algo=smd", f"hydra.run.dir={tmp_path / 'train'}") == 0
    assert smd("eval", *common, "eval.limit=2", "eviction=snapkv", "model.warmstart.steps=1", f"hydra.run.dir={tmp_path / 'eval'}") == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert {"reward", "ruler", "exact", "evidence/kept"} <= set(summary)


def test_the_config_rule_names_every_family():
    from smd_cli.config import rules

    assert rules.RULER_FAMILIES == tuple(ruler_families.FAMILIES)


def test_a_length_too_short_is_a_config_error_before_any_model_loads(tmp_path, capsys):
    assert smd("eval", "task=ruler", "task.prompt_tokens=160", "eval.limit=1", "progress=false", f"hydra.run.dir={tmp_path}") == 2
    assert "config error: task.prompt_tokens=160 is too short for task.family=niah_single" in capsys.readouterr().err
