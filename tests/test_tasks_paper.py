"""The paper's four tasks: loaders on local files of each Hub schema, prompts, truncation, rewards, and
the real reference files in ../shared/data (GSM8K test, HotpotQA dev answers, 14 GovReport reports)."""

import copy
import json
import random
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from smd_cli.tasks import govreport, gsm8k, hotpotqa, tldr
from smd_cli.tasks.govreport import GovReport
from smd_cli.tasks.gsm8k import GSM8K
from smd_cli.tasks.hotpotqa import HotpotQA
from smd_cli.tasks.loading import load_rows
from smd_cli.tasks.metrics import hotpot_em, hotpot_f1
from smd_cli.tasks.tldr import TLDR

CONF = Path(__file__).resolve().parents[1] / "conf" / "task"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with a minimal chat template, so prompts go through `apply_chat_template`."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def hotpot_row(i: int) -> dict:
    titles = [f"Title {j}" for j in range(10)]
    sentences = [[f"Paragraph {j} first sentence.", f" Paragraph {j} second sentence {i}."] for j in range(10)]
    return {"id": f"q{i}", "question": f"Which paragraph is number {i}?", "answer": f"Paragraph {i}",
            "type": "bridge", "level": "easy", "supporting_facts": {"title": ["Title 0"], "sent_id": [0]},
            "context": {"title": titles, "sentences": sentences}}


def test_gsm8k_loader_prompt_reward(tmp_path, chat_tokenizer):
    rows = [{"question": "How many?", "answer": "2 + 2 = 4\n#### 1,080"}, {"question": "Cost?", "answer": "#### 18"},
            {"question": "Q3", "answer": "#### 5"}]
    task = GSM8K(data_files={"test": str(write_jsonl(tmp_path / "test.jsonl", rows))})
    examples = task.examples("test")
    assert [e["reference"] for e in examples] == ["1080", "18", "5"]
    assert [e["id"] for e in examples] == ["gsm8k-test-0", "gsm8k-test-1", "gsm8k-test-2"]
    assert examples[0]["prompt"].startswith("How many?") and '"#### <number>"' in examples[0]["prompt"]
    assert len(task.examples("test", limit=2)) == 2
    assert task.reward("so 1,080 in all.\n#### $1,080.", examples[0]) == 1.0
    scores = task.metrics(["#### 1080", "\\boxed{18}", "#### 6"], examples)
    assert scores["accuracy"] == pytest.approx(2 / 3) and scores["reward"] == scores["accuracy"]
    assert scores["accuracy_stderr"] == pytest.approx((1 / 3 / 3) ** 0.5)  # sqrt(var_sample / n) = sqrt(1/3 / 3)
    text = chat_tokenizer.decode(task.encode_prompt(examples[0], chat_tokenizer))
    assert text.startswith("<|user|>How many?") and text.endswith("<|assistant|>")


def test_tldr_loader_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = "SUBREDDIT: r/cats\n\nTITLE: My cat\n\nPOST: My cat sat on the mat all day.\n\nTL;DR:"
    path = tmp_path / "validation.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": prompt, "completion": " cat sat on mat"}] * 2), path)
    task = TLDR(data_files={"validation": str(path)})
    (example, _) = task.examples("validation")
    assert example["reference"] == "cat sat on mat"
    assert example["document"].endswith("all day.")  # the Hub cue moves after the post
    assert example["prompt"].startswith(tldr.INSTRUCTION) and example["prompt"].endswith("all day.\n\nTL;DR:")
    assert task.reward("The cat sat on the mat", example) == pytest.approx(0.8)  # LCS 4: P 4/6, R 4/4
    scores = task.metrics(["cat sat on mat", "dog"], [example, example])
    assert scores["rougeL"] == pytest.approx(0.5) and scores["rougeLsum"] == pytest.approx(0.5)
    assert scores["rougeL_stderr"] == pytest.approx(0.5)


def test_govreport_loader_json_array(tmp_path):
    rows = [{"report": "The agency spent money. " * 50, "summary": "The agency spent money."}]
    path = tmp_path / "gov.json"
    path.write_text(json.dumps(rows))
    task = GovReport(data_files=str(path))  # one file serves every split
    (example,) = task.examples("test")
    assert example["prompt"].startswith(govreport.INSTRUCTION) and example["prompt"].endswith(govreport.CLOSING)
    assert task.reward("The agency spent money.", example) == 1.0


def test_hotpotqa_loader_prompt_and_answer_line(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "dev.jsonl", [hotpot_row(i) for i in range(3)])
    task = HotpotQA(data_files={"validation": str(path)}, max_prompt_tokens=300)
    examples = task.examples("validation")
    assert [e["id"] for e in examples] == ["q0", "q1", "q2"] and task.test_split == "validation"
    full = examples[1]["prompt"]
    assert full.count("Passage ") == 10 and "Passage 10: Title 9\nParagraph 9 first sentence." in full
    assert full.endswith("Question: Which paragraph is number 1?\nAnswer:")
    assert task.reward("Answer: paragraph 1\nBecause the passage says so.", examples[1]) == 1.0
    assert task.metrics(["Paragraph 1", "paragraph"], examples[1:]) == pytest.approx(
        {"f1": (1 + 2 / 3) / 2, "f1_stderr": 1 / 6, "em": 0.5, "em_stderr": 0.5, "reward": (1 + 2 / 3) / 2,
         "reward_stderr": 1 / 6})
    # 300 byte-tokens hold the instruction and the question but only the start of the ten paragraphs.
    text, ids = task.fit_prompt(examples[1], tiny_tokenizer)
    assert len(ids) <= 300 and len(tiny_tokenizer(full)["input_ids"]) > 700
    assert text.startswith(hotpotqa.INSTRUCTION + "\n\nPassage 1: Title 0")
    assert text.endswith("Question: Which paragraph is number 1?\nAnswer:") and "Passage 10" not in text


@pytest.mark.parametrize(
    "task_cls, row, missing",
    [
        (GSM8K, {"question": "q"}, "answer"),
        (TLDR, {"prompt": "p"}, "completion"),
        (GovReport, {"summary": "s"}, "report"),
        (HotpotQA, {"question": "q", "answer": "a"}, "context"),
    ],
)
def test_missing_field_is_named(tmp_path, task_cls, row, missing):
    path = write_jsonl(tmp_path / "x.jsonl", [row])
    with pytest.raises(KeyError, match=rf"missing field\(s\) \['{missing}'\]"):
        task_cls(data_files=str(path)).examples(task_cls.test_split)


def test_bad_files_and_splits(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' is empty"):
        GSM8K(data_files=str(empty)).examples("test")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n")
    with pytest.raises(ValueError, match="blank.jsonl.*is empty"):
        GSM8K(data_files=str(blank)).examples("test")
    with pytest.raises(FileNotFoundError, match="no such file .*nope.jsonl"):
        GSM8K(data_files=str(tmp_path / "nope.jsonl")).examples("test")
    with pytest.raises(KeyError, match="no entry for split 'test'"):
        GSM8K(data_files={"train": str(empty)}).examples("test")
    with pytest.raises(ValueError, match="splits \\['train', 'validation'\\], not 'test'"):
        HotpotQA(data_files=str(empty)).examples("test")
    with pytest.raises(ValueError, match="must all be one of"):
        (tmp_path / "x.csv").write_text("question,answer\nq,#### 1\n")
        GSM8K(data_files=str(tmp_path / "x.csv")).examples("test")
    with pytest.raises(ValueError, match="max_prompt_tokens must be a positive integer"):
        GSM8K(max_prompt_tokens=0)


def test_hub_id_fails_offline_with_the_way_out():
    with pytest.raises(RuntimeError, match="openai/gsm8k .* task.data_files"):
        GSM8K().examples("test")


def test_truncation_limits(tmp_path, tiny_tokenizer):
    long_q = write_jsonl(tmp_path / "q.jsonl", [{"question": "x " * 400, "answer": "#### 1"}])
    with pytest.raises(ValueError, match="has no document to cut"):
        GSM8K(data_files=str(long_q), max_prompt_tokens=100).encode_prompt(
            GSM8K(data_files=str(long_q)).examples("test")[0], tiny_tokenizer)
    task = HotpotQA(data_files=str(write_jsonl(tmp_path / "h.jsonl", [hotpot_row(0)])), max_prompt_tokens=50)
    with pytest.raises(ValueError, match="task.max_prompt_tokens=50 is not allowed .*its prompt is \\d+ tokens without its document"):
        task.encode_prompt(task.examples("validation")[0], tiny_tokenizer)


def test_task_configs_instantiate():
    from hydra.utils import instantiate

    expected = {"gsm8k": (GSM8K, 256), "tldr": (TLDR, 128), "govreport": (GovReport, 512), "hotpotqa": (HotpotQA, 256)}
    for name, (cls, new_tokens) in expected.items():
        task = instantiate(OmegaConf.load(CONF / f"{name}.yaml"))
        assert type(task) is cls and task.max_prompt_tokens == 2048 and task.data_files is None
        assert task.max_new_tokens == task.paper["max_new_tokens"] == new_tokens and task.paper["num_generations"] == 8
        assert task.paper["lr"] == 1e-6


# ------------------------------------------------------------------------------- real reference data


def test_gsm8k_gold_and_shuffled_real(shared_data):
    files = {"train": str(shared_data / "gsm8k" / "train.jsonl"), "test": str(shared_data / "gsm8k" / "test.jsonl")}
    task = GSM8K(data_files=files)
    examples = task.examples("test")
    assert len(examples) == 1319 and len(task.examples("train")) == 7473
    gold = [e["solution"] for e in examples]
    assert task.metrics(gold, examples)["accuracy"] == 1.0
    random.Random(0).shuffle(gold)
    shuffled = task.metrics(gold, examples)["accuracy"]
    assert shuffled <= 0.03
    assert shuffled == pytest.approx(16 / 1319)  # chance agreement with this seed: 1.2 %


def test_hotpotqa_gold_real(shared_data):
    path = shared_data / "hotpotqa" / "hotpot_dev_v1_simplified.json"
    rows, _ = load_rows(HotpotQA.hub_id, None, "validation", ("question", "answer"), data_files=str(path))
    answers = [r["answer"] for r in rows]
    assert len(answers) == 7405
    assert sum(hotpot_em(a, a) for a in answers) == 7405 and sum(hotpot_f1(a, a) for a in answers) == 7405
    # The simplified file has no passages: the task refuses it, naming the field.
    with pytest.raises(KeyError, match="missing field\\(s\\) \\['context'\\]"):
        HotpotQA(data_files=str(path)).examples("validation")


def test_govreport_real_reports_truncate(shared_data, tmp_path, chat_tokenizer):
    lines = (shared_data / "govreport" / "gov_report_summ.jsonl").read_text().splitlines()
    rows = [{"report": r["input"], "summary": r["outputs"][0]} for r in map(json.loads, lines)]  # LEval -> Hub schema
    task = GovReport(data_files={"test": str(write_jsonl(tmp_path / "test.jsonl", rows))}, max_prompt_tokens=2048)
    examples = task.examples("test")
    assert len(examples) == 14
    full = [len(task.__class__(max_prompt_tokens=None).encode_prompt(e, chat_tokenizer)) for e in examples]
    assert min(full) > 10_000  # byte-level tokens: every report overflows 2048
    for example in examples:
        text, ids = task.fit_prompt(example, chat_tokenizer)
        assert 2048 - 4 <= len(ids) <= 2048
        decoded = chat_tokenizer.decode(ids)
        assert decoded.startswith(f"<|user|>{govreport.INSTRUCTION}\n\nReport:\n" + example["document"][:200])
        assert decoded.endswith(f"{govreport.CLOSING}<|assistant|>") and text.endswith(govreport.CLOSING)
    assert task.reward(examples[0]["reference"], examples[0]) == 1.0


def test_module_names():
    assert [m.__name__.rsplit(".", 1)[1] for m in (gsm8k, tldr, govreport, hotpotqa)] == [
        "gsm8k", "tldr", "govreport", "hotpotqa"]


def test_qwen3_4b_random_config_is_the_paper_model():
    """The inline architecture builds (on the meta device, no download) into Qwen3-4B: 4.02 B parameters and
    144 KiB of bf16 KV cache per token."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    conf = OmegaConf.to_container(OmegaConf.load(CONF.parent / "model" / "qwen3_4b_random.yaml"))
    assert conf["random_init"] and conf["dtype"] == "bfloat16"
    tiny = OmegaConf.to_container(OmegaConf.load(CONF.parent / "model" / "tiny.yaml"))
    assert conf.keys() == tiny.keys() and conf["name_or_path"] is None  # no download: the tiny build path
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**conf["config"]))
    assert sum(p.numel() for p in model.parameters()) == 4_022_468_096
    c = model.config
    assert c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 2 == 144 * 1024
    assert c.rope_parameters["rope_theta"] == 5e6 and c.tie_word_embeddings


def test_prompt_records_and_length_stats(tmp_path, tiny_tokenizer):
    from smd_cli.tasks.loading import length_stats, prompt_records

    task = HotpotQA(data_files=str(write_jsonl(tmp_path / "h.jsonl", [hotpot_row(0), hotpot_row(1)])),
                    max_prompt_tokens=300)
    records = prompt_records(task, task.examples("validation"), tiny_tokenizer)
    assert [r["id"] for r in records] == ["q0", "q1"] and all(r["truncated"] for r in records)
    assert all(r["prompt_tokens"] <= 300 and r["prompt"].endswith("Answer:") for r in records)
    assert records[1]["reference"] == "Paragraph 1"
    assert length_stats([5, 1, 3, 2, 4]) == {"min": 1.0, "mean": 3.0, "p50": 3.0, "p95": 5.0, "max": 5.0}
    with pytest.raises(ValueError, match="no lengths"):
        length_stats([])
