"""Inputs are bounded before they are expensive: a data line longer than `task.max_row_bytes` is refused after reading
that many bytes (not the line), a file parsed whole above `task.max_file_bytes` from its size, and no text longer
than the prompt budget can hold is ever tokenised (a longer question is refused from its length, a longer document
cut first). Each test makes its big file in tmp_path (sparse where the content does not matter) and measures that
it stayed cheap: the Python memory traced while `smd` ran, and the longest text the tokenizer was given."""

import json
import time
import tracemalloc

import pytest
from transformers import PreTrainedTokenizerFast

import smd_cli.cli  # noqa: F401  (imported before tracing: torch, transformers and the CLI are not what is measured)
import smd_cli.stages.evaluate  # noqa: F401
import smd_cli.stages.prepare_data  # noqa: F401
from smd_cli.model.build import build_tiny_tokenizer
from smd_cli.tasks.gsm8k import INSTRUCTION
from smd_cli.tasks.loading import reach
from tests.conftest import smd

GSM8K_ROW = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}
MiB = 1 << 20


def traced(*args) -> tuple[int, float, float]:
    """(exit status, peak traced Python memory in MiB, seconds) of `smd ARGS` in this process."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        code = smd(*args)
    finally:
        peak = tracemalloc.get_traced_memory()[1] / MiB
        tracemalloc.stop()
    return code, peak, time.perf_counter() - started


@pytest.fixture
def tokenised(monkeypatch):
    """The length of every text the (tiny) tokenizer is given."""
    lengths = []
    call = PreTrainedTokenizerFast.__call__

    def spy(self, text, *args, **kwargs):
        lengths.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", spy)
    return lengths


def test_a_200_mb_line_is_refused_after_reading_the_row_limit(tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    with data.open("wb") as f:  # line 2: a 200 MB question (a sparse hole: no disk, no time to write)
        f.write(json.dumps(GSM8K_ROW).encode() + b'\n{"question": "')
        f.seek(200 * MiB, 1)
        f.write(b'", "answer": "#### 1"}\n' + json.dumps(GSM8K_ROW).encode() + b"\n")
    code, peak, seconds = traced("eval", "task=gsm8k", f"task.data_files={data}", "eval.limit=3", "progress=false",
                                 f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    assert " ".join(capsys.readouterr().err.split()) == (
        f"config error: task=gsm8k split 'test': {data}, line 2: longer than task.max_row_bytes=8388608 bytes (it was not "
        "read further); raise task.max_row_bytes to read rows this long")
    assert peak < 8 + 24 and seconds < 20, (peak, seconds)  # the 8 MiB read, plus Hydra's own (was: more than 8 GB, 31 s)


def test_a_long_question_is_refused_from_its_length_without_tokenising_it(tmp_path, capsys, tokenised):
    data = tmp_path / "test.jsonl"
    long = {"question": "How many? " + "x y " * (5 * MiB), "answer": "#### 1"}  # 20 MB of words, under a raised row limit
    data.write_text("".join(json.dumps(r) + "\n" for r in (GSM8K_ROW, long, GSM8K_ROW)))
    code, peak, seconds = traced("eval", "task=gsm8k", f"task.data_files={data}", "task.max_row_bytes=33554432", "eval.limit=3",
                                 "progress=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    limit = reach(2048, build_tiny_tokenizer())
    assert limit == 4 * 2049 * 7  # the tiny tokenizer's longest entry is 7 characters (`<|pad|>`)
    assert " ".join(capsys.readouterr().err.split()) == (
        f"config error: task.max_prompt_tokens=2048 is not allowed for gsm8k example gsm8k-test-1 ({data}, line 2): its "
        f"prompt is {len(long['question'].strip() + chr(10) * 2 + INSTRUCTION)} characters, more than {limit} characters always hold; raise "
        "task.max_prompt_tokens (within the model's positions) or leave the example out")
    assert max(tokenised) < 200  # only the short questions were tokenised (was: the 20 MB one, 4.2 GB and a traceback)
    assert peak < 6 * 20 + 24 and seconds < 20, (peak, seconds)  # the line, its text and its JSON: a few copies of 20 MB


def test_a_long_document_is_cut_before_it_is_tokenised(tmp_path, tokenised):
    report = " ".join(f"w{i % 97}" for i in range(1_000_000))  # a 5 MB GovReport report
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"report": report, "summary": "short"}) + "\n")
    out = tmp_path / "out"
    code, peak, seconds = traced("prepare-data", "task=govreport", f"task.data_files={data}", "splits=[test]", "progress=false",
                                 f"out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0
    row = json.loads((out / "test.jsonl").read_text())
    assert row["truncated"] and 2048 - 8 <= row["prompt_tokens"] <= 2048  # the budget, filled (to a word)
    assert report[:1000] in row["prompt"] and len(row["prompt"]) < 20_000
    assert max(tokenised) <= reach(2048, build_tiny_tokenizer()) + 200  # never the 5 MB report (the instruction aside)
    assert seconds < 20, seconds


def test_a_json_array_or_parquet_file_is_refused_by_its_size_before_it_is_parsed(tmp_path, capsys):
    data = tmp_path / "test.json"
    with data.open("wb") as f:
        f.write(b'[{"question": "q", "answer": "#### 1"}, ')
        f.seek(300 * MiB, 1)  # sparse: 300 MB on paper
        f.write(b"]")
    code, peak, _ = traced("prepare-data", "task=gsm8k", f"task.data_files={data}", "splits=[test]", "progress=false",
                           f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and peak < 24
    assert " ".join(capsys.readouterr().err.split()) == (
        f"config error: task=gsm8k split 'test': {data}: a JSON array file (read whole) of {300 * MiB + 41} bytes, more than "
        "task.max_file_bytes=268435456; raise task.max_file_bytes to read it (or write the rows as JSON Lines, which are read "
        "one line at a time)")
