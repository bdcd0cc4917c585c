"""Bad task data files: a malformed JSON line, a non-UTF-8 byte, a wrongly typed field. Each error names the
file, the line (or row), and what is wrong, through the task, through `load_examples` (one ConfigError)
and through the CLI (one `config error:` line, exit 2, no traceback)."""

import json
import re
from pathlib import Path

import pytest

from smd_cli.config.prompts import load_examples
from smd_cli.config.validation import ConfigError
from smd_cli.tasks.datafiles import DataFileError
from smd_cli.tasks.govreport import GovReport
from smd_cli.tasks.gsm8k import GSM8K
from smd_cli.tasks.hotpotqa import HotpotQA
from smd_cli.tasks.tldr import TLDR

GOOD = {
    GSM8K: {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
    TLDR: {"prompt": "SUBREDDIT: r/cats\n\nPOST: My cat sat.\n\nTL;DR:", "completion": " cat sat"},
    GovReport: {"report": "The agency spent money.", "summary": "Money was spent."},
    HotpotQA: {"id": "q0", "question": "Which?", "answer": "Title 0", "type": "bridge",
               "context": {"title": ["Title 0", "Title 1"], "sentences": [["A.", " B."], ["C."]]}},
}


def write_lines(path: Path, lines: list) -> str:
    """Rows (dicts, dumped as JSON) and raw lines (str) as one JSON Lines file."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("task_cls", list(GOOD), ids=lambda c: c.name)
def test_malformed_json_line_names_file_line_and_problem(tmp_path, task_cls):
    good = json.dumps(GOOD[task_cls])
    path = write_lines(tmp_path / "data.jsonl", [GOOD[task_cls], GOOD[task_cls], good[:-1] + ',}', GOOD[task_cls]])
    with pytest.raises(DataFileError) as err:
        task_cls(data_files=path).examples(task_cls.test_split)
    message = str(err.value)
    assert message.startswith(f"{path}, line 3: not valid JSON (Expecting property name enclosed in double quotes at column ")
    assert "each line must be one JSON object (JSON Lines)" in message and ",}'" in message  # the snippet shows the spot


def test_json_line_errors_through_load_examples(tmp_path):
    truncated = write_lines(tmp_path / "cut.jsonl", [GOOD[GSM8K], '{"question": "q2", "answer": "#### 2"'])
    with pytest.raises(ConfigError) as err:
        load_examples(GSM8K(data_files=truncated), "test")
    assert str(err.value) == (f"task=gsm8k split 'test': {truncated}, line 2: not valid JSON (Expecting ',' delimiter at "
                              "the end of the line): '{\"question\": \"q2\", \"answer\": \"#### 2\"'; each line must be one "
                              "JSON object (JSON Lines)")
    not_json = write_lines(tmp_path / "text.jsonl", [GOOD[GSM8K], "", "this is not json"])
    with pytest.raises(ConfigError, match=re.escape(f"{not_json}, line 3: not valid JSON (Expecting value at column 1)")):
        load_examples(GSM8K(data_files=not_json), "test")
    a_list = write_lines(tmp_path / "list.jsonl", [GOOD[GSM8K], [1, 2]])
    with pytest.raises(ConfigError, match=re.escape(f"{a_list}, line 2: expected a JSON object (one row of fields), found an array ([1, 2])")):
        load_examples(GSM8K(data_files=a_list), "test")


def test_json_array_errors_name_the_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"question": "q1", "answer": "#### 1"},\n  {"question": "q2" "answer": "#### 2"}\n]\n')
    with pytest.raises(DataFileError, match=re.escape(f"{path}, line 3, column 21: not valid JSON (Expecting ',' delimiter)")):
        GSM8K(data_files=str(path)).examples("test")
    path.write_text('[\n  {"question": "q1", "answer": "#### 1"},\n\n  {"question": "q2", "answer": 2}\n]\n')
    with pytest.raises(DataFileError, match=re.escape(f"{path}, element 1 (line 4): field 'answer' is an integer (2), expected a string")):
        GSM8K(data_files=str(path)).examples("test")
    path.write_text('[{"question": "q1", "answer": "#### 1"}] trailing')
    with pytest.raises(DataFileError, match=re.escape(f"{path}, line 1, column 42: not valid JSON (extra data after the closing ']')")):
        GSM8K(data_files=str(path)).examples("test")


def test_non_utf8_names_file_line_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    first = json.dumps(GOOD[GSM8K]).encode() + b"\n"
    path.write_bytes(first + b'{"question": "caf\xe9 costs?", "answer": "#### 3"}\n')
    offset = len(first) + len('{"question": "caf')
    with pytest.raises(ConfigError) as err:
        load_examples(GSM8K(data_files=str(path)), "test")
    assert str(err.value) == (f"task=gsm8k split 'test': {path}, line 2: not UTF-8 text: byte 0xe9 at byte offset {offset} "
                              "(byte 18 of the line; invalid continuation byte); save the file as UTF-8, e.g. "
                              "`iconv -f latin1 -t utf-8 IN > OUT`")
    array = tmp_path / "latin1.json"
    array.write_bytes(b'[\n{"question": "q", "answer": "#### 1"},\n{"question": "\xff", "answer": "#### 1"}]')
    with pytest.raises(DataFileError, match=re.escape(f"{array}, line 3: not UTF-8 text: byte 0xff at byte offset 55 (byte 15 of the line")):
        GSM8K(data_files=str(array)).examples("test")
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes('{"question": "q", "answer": "#### 1"}\n'.encode("utf-16"))
    with pytest.raises(DataFileError, match=r"line 1: not UTF-8 text \(the file starts with a UTF-16 byte-order mark\).*iconv -f utf-16"):
        GSM8K(data_files=str(utf16)).examples("test")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + first)  # a UTF-8 byte-order mark is fine
    assert GSM8K(data_files=str(bom)).examples("test")[0]["reference"] == "4"


@pytest.mark.parametrize(
    "task_cls, field, value, found, expected",
    [
        (GSM8K, "answer", 72, "an integer (72)", "a string"),
        (GSM8K, "answer", None, "null", "a string"),
        (GSM8K, "question", ["q"], "an array (['q'])", "a string"),
        (TLDR, "completion", None, "null", "a string"),
        (TLDR, "prompt", 3.5, "a number (3.5)", "a string"),
        (GovReport, "report", {"text": "r"}, "an object ({'text': 'r'})", "a string"),
        (GovReport, "summary", True, "a boolean (True)", "a string"),
        (HotpotQA, "answer", 1912, "an integer (1912)", "a string"),
        (HotpotQA, "context", "Title 0: A.", "a string ('Title 0: A.')", "an object"),
    ],
)
def test_wrong_field_type_names_file_line_field_and_types(tmp_path, task_cls, field, value, found, expected):
    path = write_lines(tmp_path / "data.jsonl", [GOOD[task_cls], {**GOOD[task_cls], field: value}])
    with pytest.raises(ConfigError) as err:
        load_examples(task_cls(data_files=path), task_cls.test_split)
    assert str(err.value) == (f"task={task_cls.name} split {task_cls.test_split!r}: {path}, line 2: "
                              f"field {field!r} is {found}, expected {expected}")


def test_nested_and_row_level_problems_name_the_line(tmp_path):
    bad = {**GOOD[HotpotQA], "context": {"title": ["Title 0", "Title 1"], "sentences": [["A."], ["C.", 7]]}}
    path = write_lines(tmp_path / "hotpot.jsonl", [GOOD[HotpotQA], bad])
    with pytest.raises(DataFileError, match=re.escape(
            f"{path}, line 2: hotpotqa row q0: field 'context.sentences[1][1]' is an integer (7), expected a string")):
        HotpotQA(data_files=path).examples("validation")
    path = write_lines(tmp_path / "gsm.jsonl", [GOOD[GSM8K], {"question": "q", "answer": "no final number"}])
    with pytest.raises(DataFileError, match=re.escape(f"{path}, line 2: field 'answer' holds no final '#### N' number: 'no final number'")):
        GSM8K(data_files=path).examples("test")
    path = write_lines(tmp_path / "some.jsonl", [GOOD[GSM8K], {"question": "q"}])  # other rows have the field
    with pytest.raises(KeyError, match=re.escape(f"{path}, line 2: missing field(s) ['answer']; the row has ['question']")):
        GSM8K(data_files=path).examples("test")


def test_parquet_rows_are_named_by_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": None}]), path)
    with pytest.raises(DataFileError, match=re.escape(f"{path}, row index 1: field 'completion' is null, expected a string")):
        TLDR(data_files=str(path)).examples("test")
    path.write_bytes(b"not a parquet file")
    with pytest.raises(DataFileError, match=re.escape(f"{path}: not a readable parquet file (ArrowInvalid: ")):
        TLDR(data_files=str(path)).examples("test")


def test_limit_stops_before_a_later_bad_line(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [GOOD[GSM8K], GOOD[GSM8K], "{broken"])
    assert len(GSM8K(data_files=path).examples("test", limit=2)) == 2
    with pytest.raises(DataFileError, match="line 3: not valid JSON"):
        GSM8K(data_files=path).examples("test")


def test_real_gsm8k_with_a_corrupted_line(shared_data, tmp_path):
    """The first 40 lines of the real GSM8K test file, line 17 cut short and line 29's answer an int."""
    lines = (shared_data / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:40]
    cut = list(lines)
    cut[16] = cut[16][:-20]
    path = write_lines(tmp_path / "test.jsonl", cut)
    with pytest.raises(ConfigError, match=re.escape(f"{path}, line 17: not valid JSON (")):
        load_examples(GSM8K(data_files=path), "test")
    typed = list(lines)
    typed[28] = json.dumps({**json.loads(typed[28]), "answer": 18})
    path = write_lines(tmp_path / "test.jsonl", typed)
    with pytest.raises(ConfigError, match=re.escape(f"{path}, line 29: field 'answer' is an integer (18), expected a string")):
        load_examples(GSM8K(data_files=path), "test")


@pytest.mark.parametrize("content, shown", [
    (b'{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": 5}\n', "line 2: field 'answer' is an integer (5), expected a string"),
    (b'{"question": "q", "answer": "#### 1"}\n{"question": "q2" "answer": "#### 2"}\n', "line 2: not valid JSON (Expecting ',' delimiter at column 19)"),
    (b'{"question": "caf\xe9", "answer": "#### 1"}\n', "line 1: not UTF-8 text: byte 0xe9 at byte offset 17"),
], ids=["type", "json", "utf8"])
def test_cli_prints_one_config_error_line(tmp_path, capsys, content, shown):
    """`smd prepare-data task=gsm8k task.data_files=BAD`: exit 2, `config error:` with the file and line, no traceback."""
    from smd_cli.cli import main

    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_:
        main(["prepare-data", "task=gsm8k", f"task.data_files={path}", "splits=[test]", "progress=false",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at the terminal's width
    assert err.startswith(f"config error: task=gsm8k split 'test': {path}, {shown}") and "Traceback" not in err
    assert not (tmp_path / "run" / "test.jsonl").exists()


@pytest.mark.parametrize("content, shown", [
    ('{"question": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "#### 1"}\n',
     "line 2: nested too deeply for the JSON reader (Python's recursion limit); a row is one JSON object of fields"),
    ('{"question": "a \\ud800 b", "answer": "#### 1"}\n',
     "line 2: field 'question' holds a lone UTF-16 surrogate (\\ud800 at character 2), which is not text"),
], ids=["100,000 deep", "lone surrogate"])
def test_a_deep_or_non_text_json_line_is_named_with_its_file_and_line(tmp_path, capsys, content, shown):
    """Issue 40's probe: a 100,000-deep line was "maximum recursion depth exceeded ..." without the file or line; a lone
    surrogate reached the tokenizer (a TypeError traceback)."""
    from tests.conftest import smd

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD[GSM8K]) + "\n" + content)
    assert smd("prepare-data", "task=gsm8k", f"task.data_files={path}", "splits=[test]", "progress=false",
               f"hydra.run.dir={tmp_path / 'run'}") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"config error: task=gsm8k split 'test': {path}, {shown}") and "Traceback" not in err, err


def test_a_json_array_with_a_lone_surrogate_or_cut_anywhere_is_named_with_its_line(tmp_path):
    rows = [GOOD[GSM8K], {"question": "q2", "answer": "#### 2"}]
    for text in (json.dumps(rows, indent=2), json.dumps(rows)):  # a truncated array: every place it can be cut
        for cut in range(1, len(text)):
            path = tmp_path / "cut.json"
            path.write_text(text[:cut])
            with pytest.raises(DataFileError, match=re.escape(str(path)) + r", line \d+, column \d+: not valid JSON \("):
                GSM8K(data_files=str(path)).examples("test")
    path = tmp_path / "surrogate.json"
    path.write_text(json.dumps([GOOD[GSM8K]]).rstrip("]") + ', {"question": {"x": ["a \\udc00"]}, "answer": "#### 1"}]')
    with pytest.raises(DataFileError, match=re.escape(f"{path}, element 1 (line 1): field 'question.x[0]' holds a lone UTF-16 "
                                                      "surrogate (\\udc00 at character 2)")):
        GSM8K(data_files=str(path)).examples("test")


def test_a_fifo_is_called_a_link_only_when_it_is_one(tmp_path):
    """Issue 40's probe: a FIFO reached through a linked folder or a path with `..` was called "a link to ..."."""
    import os

    from smd_cli.tasks.datafiles import not_a_regular_file

    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "fifo.jsonl")
    (tmp_path / "folder").symlink_to(tmp_path / "data")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "data" / "fifo.jsonl")
    for path in (tmp_path / "folder" / "fifo.jsonl", tmp_path / "data" / ".." / "data" / "fifo.jsonl"):
        assert not_a_regular_file(path) == "a named pipe (FIFO)"
    assert not_a_regular_file(tmp_path / "link.jsonl") == f"a named pipe (FIFO) (a link to {tmp_path / 'data' / 'fifo.jsonl'})"
