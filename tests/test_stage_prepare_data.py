"""`smd prepare-data` as a function: counts, token-length statistics recomputed here with the tokenizer
itself, truncation that keeps the question, and errors that name the field, file or key."""

import json
import statistics
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.config.validation import ConfigError
from smd_cli.model.build import build_tiny_tokenizer
from smd_cli.stages import prepare_data as stage
from smd_cli.tasks import govreport, gsm8k
from smd_cli.tasks.synthetic import MajorityVote

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAIN = [("What is 2 + 2?", "2 + 2 = 4\n#### 4"), ("Tom has 1,000 apples and eats 1. How many are left?", "#### 999"),
         ("A farmer has 12 cows and buys 30 more. How many cows?", "12 + 30 = 42\n#### 42")]
TEST = [("What is 3 * 5?", "#### 15"), ("What is 9 - 4?", "#### 5"), ("How much is $1,080 + $20?", "#### $1,100"),
        ("What is 6 / 3?", "#### 2"), ("A train leaves at 3 pm and arrives at 5 pm. How many hours?", "#### 2")]


def config(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("prepare_data", overrides=["progress=false", f"+run_dir={tmp_path / 'run'}", *overrides])


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def gsm8k_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"question": q, "answer": a} for q, a in TRAIN])
    test = write_jsonl(tmp_path / "test.jsonl", [{"question": q, "answer": a} for q, a in TEST])
    return f"task.data_files={{train:'{train}',test:'{test}'}}"


def test_gsm8k_counts_and_token_statistics(tmp_path, gsm8k_files):
    summary = stage.run(config(tmp_path, "task=gsm8k", gsm8k_files))
    tok = build_tiny_tokenizer()
    for split, pairs in (("train", TRAIN), ("test", TEST)):
        rows = read_jsonl(tmp_path / "run" / f"{split}.jsonl")
        assert [r["id"] for r in rows] == [f"gsm8k-{split}-{i}" for i in range(len(pairs))]
        assert [r["meta"]["question"] for r in rows] == [q for q, _ in pairs]
        # no chat template in the tiny tokenizer: the prompt text plus <bos>
        prompts = [f"{q}\n\n{gsm8k.INSTRUCTION}" for q, _ in pairs]
        lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) + 1 for p in prompts]
        assert [r["prompt"] for r in rows] == prompts and [r["prompt_tokens"] for r in rows] == lengths
        s = summary["splits"][split]
        assert s["n"] == len(pairs) and s["truncated"] == 0
        assert s["prompt_tokens"] == pytest.approx({"min": min(lengths), "mean": statistics.mean(lengths),
                                                    "p50": statistics.median_low(lengths), "p95": max(lengths), "max": max(lengths)})
    assert [r["reference"] for r in read_jsonl(tmp_path / "run" / "test.jsonl")] == ["15", "5", "1100", "2", "2"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert (tmp_path / "run" / "provenance.json").is_file()


def test_govreport_truncation_keeps_the_request(tmp_path):
    words = ["budget", "agency", "report", "funds", "oversight"]
    reports = [" ".join(words[i % 5] for i in range(n)) for n in (10, 200, 400)]
    path = write_jsonl(tmp_path / "test.jsonl", [{"report": r, "summary": f"summary {i}"} for i, r in enumerate(reports)])
    budget = 300
    summary = stage.run(config(tmp_path, "task=govreport", f"task.data_files='{path}'", f"task.max_prompt_tokens={budget}",
                               "splits=[test]", "limit=3"))
    tok = build_tiny_tokenizer()
    full = [len(tok(f"{govreport.INSTRUCTION}\n\nReport:\n{r}\n\n{govreport.CLOSING}", add_special_tokens=False)["input_ids"]) + 1
            for r in reports]
    rows = read_jsonl(tmp_path / "run" / "test.jsonl")
    cut = [n > budget for n in full]
    assert cut == [False, True, True] and [r["truncated"] for r in rows] == cut
    assert rows[0]["prompt_tokens"] == full[0]
    for row in rows[1:]:
        assert budget - 3 <= row["prompt_tokens"] <= budget  # cut to the budget, up to a re-tokenised boundary
        assert row["prompt"].startswith(govreport.INSTRUCTION) and row["prompt"].endswith(govreport.CLOSING)
    lengths = [r["prompt_tokens"] for r in rows]
    s = summary["splits"]["test"]
    assert (s["n"], s["truncated"], s["prompt_tokens"]["min"], s["prompt_tokens"]["max"]) == (3, 2, full[0], max(lengths[1:]))
    assert s["prompt_tokens"]["mean"] == pytest.approx(sum(lengths) / 3)
    assert [r["reference"] for r in rows] == ["summary 0", "summary 1", "summary 2"]
    assert "meta" not in rows[0]  # the document is in the prompt, not repeated


def test_default_task_and_out_dir(tmp_path):
    out = tmp_path / "data"
    summary = stage.run(config(tmp_path, "task.prompt_tokens=48", "limit=4", f"out_dir={out}"))
    task = MajorityVote(prompt_tokens=48, max_new_tokens=4)
    for split in ("train", "test"):
        rows = read_jsonl(out / f"{split}.jsonl")
        want = task.examples(split, limit=4)
        assert [(r["id"], r["prompt"], r["reference"]) for r in rows] == [(e["id"], e["prompt"], e["reference"]) for e in want]
        assert [r["meta"]["needle_offsets"] for r in rows] == [e["needle_offsets"] for e in want]
        assert [r["meta"]["evidence"] for r in rows] == [e["evidence"] for e in want]
        assert {r["prompt_tokens"] for r in rows} == {49}  # 48 single-token words + <bos>
        assert summary["splits"][split]["prompt_tokens"] == {"min": 49, "mean": 49, "p50": 49, "p95": 49, "max": 49}
    assert json.loads((out / "summary.json").read_text()) == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not (tmp_path / "run" / "test.jsonl").exists()


def test_errors_name_the_field_file_or_key(tmp_path, gsm8k_files):
    no_answer = write_jsonl(tmp_path / "bad.jsonl", [{"question": "What is 1 + 1?", "solution": "2"}])
    with pytest.raises(ConfigError, match=r"missing field\(s\) \['answer'\]"):
        stage.run(config(tmp_path, "task=gsm8k", f"task.data_files='{no_answer}'"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"empty.jsonl' is empty \(split 'train'\)"):
        stage.run(config(tmp_path, "task=gsm8k", f"task.data_files='{tmp_path / 'empty.jsonl'}'"))
    with pytest.raises(ConfigError, match="no such file .*missing.jsonl"):
        stage.run(config(tmp_path, "task=gsm8k", f"task.data_files='{tmp_path / 'missing.jsonl'}'"))
    with pytest.raises(ConfigError, match=r"gsm8k has splits \['train', 'test'\], not 'validation'"):
        stage.run(config(tmp_path, "task=gsm8k", gsm8k_files, "splits=[validation]"))
    with pytest.raises(ConfigError, match="task=vote split 'dev'"):
        stage.run(config(tmp_path, "splits=[dev]", "limit=2"))
    with pytest.raises(ConfigError, match="limit=0 is not allowed: null .* or an integer >= 1"):
        stage.run(config(tmp_path, "limit=0"))
    with pytest.raises(ConfigError, match=r"splits=\[\] is not allowed"):
        stage.run(config(tmp_path, "splits=[]"))
    with pytest.raises(ConfigError, match="model.name_or_path='/no/such/model': could not load its tokenizer"):
        stage.run(config(tmp_path, "model=qwen3_4b", "model.name_or_path=/no/such/model", "limit=2"))


def test_threads_accepted_like_every_stage(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        summary = stage.run(config(tmp_path, "threads=1", "task.prompt_tokens=24", "limit=2", "splits=[test]"))
        assert summary["splits"]["test"]["n"] == 2 and torch.get_num_threads() == 1
        assert json.loads((tmp_path / "run" / "config.json").read_text())["threads"] == 1
    finally:
        torch.set_num_threads(before)
    assert config(tmp_path).threads is None  # default: torch's own
    with pytest.raises(ConfigError, match=r"threads=0 is not allowed: null \(torch's default\) or an integer >= 1"):
        stage.run(config(tmp_path, "threads=0"))


def test_cheap_checks_before_the_tokenizer_and_the_data(tmp_path, gsm8k_files):
    # an unknown split is named before the (missing) tokenizer is looked for
    with pytest.raises(ConfigError, match=r"task=gsm8k split 'validation': gsm8k has splits \['train', 'test'\], not 'validation'"):
        stage.run(config(tmp_path, "task=gsm8k", gsm8k_files, "splits=[validation]", "model=qwen3_4b",
                         "model.name_or_path=/no/such/model"))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"out_dir='.*a_file' is not allowed: a folder \(this path is an existing file\)"):
        stage.run(config(tmp_path, f"out_dir={tmp_path / 'a_file'}", "limit=2"))


@pytest.mark.parametrize("task", ["task=passkey task.prompt_tokens=64", "task=ruler task.family=niah_single task.prompt_tokens=512"])
def test_a_task_built_to_a_length_is_never_called_truncated(tmp_path, task):
    """Passkey and RULER build each prompt to `prompt_tokens` (its text is not the example's placeholder): nothing was
    cut, and the summary says 0 truncated (it said every prompt)."""
    out = tmp_path / "data"
    summary = stage.run(config(tmp_path, *task.split(), "limit=3", "splits=[test]", "model=tiny", f"out_dir={out}"))
    assert summary["splits"]["test"]["truncated"] == 0
    assert [r["truncated"] for r in read_jsonl(out / "test.jsonl")] == [False] * 3
