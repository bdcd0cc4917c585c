"""Passkey's `task.haystack_file` through `smd prepare-data`: read row by row like every data file (a bad row named by
file and line, never an AttributeError or a bare "utf-8" error), bounded by `task.max_file_bytes` from its size
before it is read (its reports are kept in memory), and never silently ignored (`task.haystack=filler` with a file
is a config error naming both keys). Each run is in this process with the tiny tokenizer: about a second."""

import json

import pytest

from tests.conftest import smd

WORDS = " ".join(f"w{i}" for i in range(150))  # one report of 150 words (a haystack needs > 100)


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def prepare(tmp_path, haystack_file, *extra) -> int:
    return smd("prepare-data", "task=passkey", "task.haystack=govreport", f"task.haystack_file={haystack_file}",
               "task.prompt_tokens=48", "task.depth=0.5", "splits=[test]", "limit=1", "progress=false", *extra,
               f"hydra.run.dir={tmp_path / 'run'}")


def lines(tmp_path, *rows: str):
    path = tmp_path / "reports.jsonl"
    path.write_text("".join(row + "\n" for row in rows))
    return path


def test_a_haystack_file_is_read_and_the_key_hidden_in_its_report(tmp_path, capsys):
    path = lines(tmp_path, json.dumps({"report": "too short to be used"}), json.dumps({"input": WORDS}))
    assert prepare(tmp_path, path, f"task.max_file_bytes={path.stat().st_size}") == 0  # exactly the limit: read
    row = json.loads((tmp_path / "run" / "test.jsonl").read_text().splitlines()[0])
    assert row["meta"]["haystack"] == "govreport[0]"  # the one report of > 100 words (the tiny tokenizer decodes none of it)


def test_a_haystack_file_with_the_filler_haystack_is_a_config_error_naming_both_keys(tmp_path, capsys):
    path = lines(tmp_path, json.dumps({"input": WORDS}))
    assert smd("prepare-data", "task=passkey", f"task.haystack_file={path}", "splits=[test]", "limit=1", "progress=false",
               f"hydra.run.dir={tmp_path / 'run'}") == 2
    assert said(capsys) == (f"config error: task: task.haystack_file='{path}' is not allowed with task.haystack=filler, which "
                            "never reads it: set task.haystack=govreport to hide the key in its reports, or task.haystack_file=null")


@pytest.mark.parametrize("row, why", [
    ("[1, 2]", "expected a JSON object (one row of fields), found an array ([1, 2])"),
    ('{"report": 5}', "field 'report' is an integer (5), expected a string (the report's text)"),
    ('{"input": ["a", "b"]}', "field 'input' is an array (['a', 'b']), expected a string (the report's text)"),
    ('{"report": "abc"', "not valid JSON (Expecting ',' delimiter at the end of the line)"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, capsys, row, why):
    path = lines(tmp_path, json.dumps({"input": WORDS}), row)
    assert prepare(tmp_path, path) == 2
    err = said(capsys)
    assert err.startswith(f"config error: task: {path}, line 2: {why}"), err


def test_a_binary_file_is_named_as_not_utf8_text(tmp_path, capsys):
    path = tmp_path / "reports.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert prepare(tmp_path, path) == 2
    assert said(capsys).startswith(f"config error: task: {path}, line 1: not UTF-8 text: byte 0x89 at byte offset 0")


def test_a_file_above_max_file_bytes_is_refused_from_its_size_unread(tmp_path, capsys):
    path = lines(tmp_path, json.dumps({"input": WORDS}))
    size = path.stat().st_size
    assert prepare(tmp_path, path, f"task.max_file_bytes={size - 1}") == 2
    assert said(capsys) == (f"config error: task: task.haystack_file='{path}' is not allowed: {size} bytes, more than "
                            f"task.max_file_bytes={size - 1} (its reports are kept in memory); raise task.max_file_bytes or "
                            "give fewer reports")
