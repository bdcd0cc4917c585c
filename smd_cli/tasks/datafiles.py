"""Reading local data files row by row, with errors that name the file, the line (or row) and what is wrong.

`read_rows(path, limit)` returns `(rows, where)`: the rows as dicts and, for each, where it is in the
file (`PATH, line N` for JSON Lines, `PATH, element I (line N)` for a JSON array, `PATH, row index I` for
parquet), so a later check of a row can name its place. `check_fields` checks one row against the
field types of a task's schema. Every problem is a `DataFileError` (a ValueError) whose message says the
file, the place and the fix. Reading is bounded before it is expensive: a path must be a regular file
(a FIFO or a link to /dev/zero would block or never end), a JSON Lines line is read at most `max_row_bytes`
at a time and a longer one is refused without reading the rest, and a file that is parsed whole (a JSON array,
parquet) is refused above `max_file_bytes`, from its size on disk. E.g.

    data/test.jsonl, line 2: not valid JSON (Expecting ',' delimiter at column 37): '{"question": "q2" "answer": ...'
    data/test.jsonl, line 2: not UTF-8 text: byte 0xe9 at byte offset 61 (byte 15 of the line) ...
    data/test.jsonl, line 2: field 'answer' is an integer (5), expected a string
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FieldTypes = Mapping[str, type | tuple[type, ...]]
_WHITESPACE = b" \t\r\n"
MAX_ROW_BYTES = 8 << 20  # a JSON Lines line (GovReport's longest reports are about 0.3 MB)
MAX_FILE_BYTES = 256 << 20  # a file parsed whole (a JSON array, parquet)
_JSON_NAMES = {str: "a string", dict: "an object", list: "an array", int: "an integer", float: "a number",
               bool: "a boolean"}


class DataFileError(ValueError):
    """A data file, or one of its rows, that the task cannot read; the message names the file and the place."""


def type_name(expected: type | tuple[type, ...]) -> str:
    """`str` -> 'a string', `(list, tuple)` -> 'an array'."""
    kinds = expected if isinstance(expected, tuple) else (expected,)
    names = dict.fromkeys(_JSON_NAMES.get(k, f"a {k.__name__}") for k in kinds)
    return " or ".join(names)


def describe(value: Any) -> str:
    """What a value is, in JSON terms, with a short preview: 'an integer (5)', 'null', 'a string ('abc')'."""
    if value is None:
        return "null"
    name = _JSON_NAMES.get(type(value), f"a {type(value).__name__}")
    preview = repr(value)
    return f"{name} ({preview if len(preview) <= 40 else preview[:37] + '...'})"


def check_type(value: Any, expected: type | tuple[type, ...], field: str) -> None:
    """A ValueError naming `field`, the type found and the type expected, unless `value` is an `expected`."""
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if not isinstance(value, kinds) or (type(value) is bool and not {bool, object} & set(kinds)):
        raise DataFileError(f"field {field!r} is {describe(value)}, expected {type_name(expected)}")


def check_fields(row: dict, where: str, field_types: FieldTypes) -> None:
    """Each field of `field_types` is present in `row` and of its type; else an error naming `where`."""
    missing = [f for f in field_types if f not in row]
    if missing:
        raise KeyError(f"{where}: missing field(s) {missing}; the row has {list(row)}")
    for field, expected in field_types.items():
        try:
            check_type(row[field], expected, field)
        except DataFileError as err:
            raise DataFileError(f"{where}: {err}") from None


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a UTF-16 surrogate can only come from an escape: bytes would not decode


def _too_deep(where: str) -> DataFileError:
    return DataFileError(f"{where}: nested too deeply for the JSON reader (Python's recursion limit); a row is one JSON object "
                         "of fields, each a string, a number or a shallow list or object")


def check_text(value: Any, where: str, field: str | None = None) -> None:
    """A DataFileError naming `where` and the field when a string in `value` holds a lone UTF-16 surrogate (`"\\ud800"`
    in JSON): not text, so no tokenizer or UTF-8 writer can take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataFileError(f"{where}: field {field!r} holds a lone UTF-16 surrogate (\\u{ord(value[err.start]):04x} at "
                                f"character {err.start}), which is not text; an escaped surrogate must be one of a pair "
                                "(\\ud83d\\ude00), or write the character itself") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, where, key if field is None else f"{field}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, where, f"{field}[{i}]")


def _snippet(line: str, column: int, width: int = 80) -> str:
    """`line` around 1-based `column`, at most `width` characters, as a repr."""
    line = line.rstrip("\r\n")
    start = max(0, min(column - 1 - width // 2, len(line) - width))
    text = line[start : start + width]
    return repr(("..." if start > 0 else "") + text + ("..." if start + width < len(line) else ""))


def _not_utf8(path: Path, err: UnicodeDecodeError, offset: int, line: int, line_start: int, head: bytes) -> DataFileError:
    """The message of a UnicodeDecodeError at byte `offset` of the file (on `line`, which starts at `line_start`)."""
    bad = err.object[err.start : err.start + 1]
    hint, source = "", "latin1"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        hint, source = " (the file starts with a UTF-16 byte-order mark)", "utf-16"
    return DataFileError(
        f"{path}, line {line}: not UTF-8 text{hint}: byte 0x{bad.hex()} at byte offset {offset} "
        f"(byte {offset - line_start + 1} of the line; {err.reason}); save the file as UTF-8, "
        f"e.g. `iconv -f {source} -t utf-8 IN > OUT`"
    )


def _first_byte(path: Path) -> tuple[bytes, bytes]:
    """(the first non-whitespace byte after an optional UTF-8 BOM, the first 4 bytes of the file)."""
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0)
        while chunk := f.read(65536):
            stripped = chunk.lstrip(_WHITESPACE)
            if stripped:
                return stripped[:1], head
    return b"", head


def not_a_regular_file(path: Path) -> str | None:
    """What `path` is when it exists but is not a regular file (a FIFO, a device, a folder), naming a symlink's
    target; None for a regular file or a missing path."""
    try:
        mode = os.stat(path).st_mode  # follows symlinks: a link to /dev/zero is a character device
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return kind + (f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else "")  # the path itself, not a folder on it


def _too_big(path: Path, size: int, limit: int, what: str, key: str) -> DataFileError:
    return DataFileError(f"{path}: {what} of {size} bytes, more than {key}={limit}; raise {key} to read it"
                         + (" (or write the rows as JSON Lines, which are read one line at a time)" if "file" in key else ""))


def _lines(f, max_row_bytes: int):
    """(line number, raw line) of an open binary file, each line read at most `max_row_bytes` (+ its newline)
    at a time: a longer one is a DataFileError (`_LongLine`) before the rest of it is read."""
    number = 0
    while raw := f.readline(max_row_bytes + 1):
        number += 1
        if len(raw) > max_row_bytes and not (len(raw) == max_row_bytes + 1 and raw.endswith(b"\n")):
            raise _LongLine(number)
        yield number, raw


class _LongLine(Exception):
    def __init__(self, number: int):
        super().__init__(number)
        self.number = number


def _json_lines(path: Path, limit: int | None, max_row_bytes: int = MAX_ROW_BYTES,
                max_file_bytes: int = MAX_FILE_BYTES) -> tuple[list[dict], list[str]]:
    """JSON Lines: one object per line, blank lines skipped; a line longer than `max_row_bytes` is refused."""
    try:
        return _json_lines_bounded(path, limit, max_row_bytes, max_file_bytes)
    except _LongLine as long:
        raise DataFileError(f"{path}, line {long.number}: longer than task.max_row_bytes={max_row_bytes} bytes (it was not "
                            "read further); raise task.max_row_bytes to read rows this long") from None


def _json_lines_bounded(path: Path, limit: int | None, max_row_bytes: int, max_file_bytes: int) -> tuple[list[dict], list[str]]:
    rows, where = [], []
    offset = 0
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(0)
        for number, raw in _lines(f, max_row_bytes):
            start = offset
            offset += len(raw)
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8) :], start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, err, start + err.start, number, start, head) from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except RecursionError:
                raise _too_deep(f"{path}, line {number}") from None
            except json.JSONDecodeError as err:
                if not rows and (single := _single_object(path, max_file_bytes)) is not None:  # one pretty-printed object
                    return [single], [f"{path}, line {number}"]
                at = "at the end of the line" if err.pos >= len(line.rstrip()) else f"at column {err.colno}"
                raise DataFileError(
                    f"{path}, line {number}: not valid JSON ({err.msg} {at}): {_snippet(line, err.colno)}; "
                    "each line must be one JSON object (JSON Lines)"
                ) from None
            if not isinstance(value, dict):
                raise DataFileError(f"{path}, line {number}: expected a JSON object (one row of fields), found {describe(value)}")
            if _ESCAPED_SURROGATE.search(raw):
                check_text(value, f"{path}, line {number}")
            rows.append(value)
            where.append(f"{path}, line {number}")
            if limit is not None and len(rows) >= limit:
                break
    return rows, where


def _single_object(path: Path, max_file_bytes: int = MAX_FILE_BYTES) -> dict | None:
    """The file as one JSON object, or None when it is not one (or too big to be read whole)."""
    if path.stat().st_size > max_file_bytes:
        return None
    try:
        value = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _decode_whole(path: Path) -> str:
    data = path.read_bytes()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = skip + err.start
        line_start = data.rfind(b"\n", 0, offset) + 1
        raise _not_utf8(path, err, offset, data.count(b"\n", 0, offset) + 1, line_start, data[:4]) from None


def _json_array(path: Path, limit: int | None) -> tuple[list[dict], list[str]]:
    """A JSON array of objects, scanned element by element so that each keeps its line."""
    text = _decode_whole(path)
    decoder = json.JSONDecoder()

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    def fail(pos: int, what: str) -> DataFileError:
        start = text.rfind("\n", 0, pos) + 1
        end = text.find("\n", pos)
        line, column = text.count("\n", 0, pos) + 1, pos - start + 1
        line_text = text[start : len(text) if end < 0 else end]
        return DataFileError(f"{path}, line {line}, column {column}: not valid JSON ({what}): {_snippet(line_text, column)}")

    rows, where = [], []
    pos, line, counted = skip(text.index("[") + 1), 1, 0
    if pos < len(text) and text[pos] == "]":
        return rows, where
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise fail(err.pos, err.msg) from None
        except RecursionError:
            raise _too_deep(f"{path}, element {len(rows)} (line {line + text.count(chr(10), counted, pos)})") from None
        line += text.count("\n", counted, pos)
        counted = pos
        if not isinstance(value, dict):
            raise DataFileError(f"{path}, element {len(rows)} (line {line}): expected a JSON object (one row of fields), "
                                f"found {describe(value)}")
        check_text(value, f"{path}, element {len(rows)} (line {line})")
        rows.append(value)
        where.append(f"{path}, element {len(rows) - 1} (line {line})")
        if limit is not None and len(rows) >= limit:
            return rows, where
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
        elif pos < len(text) and text[pos] == "]":
            break
        else:
            raise fail(pos, "expected ',' or ']' after an element of the array")
    if skip(pos + 1) < len(text):
        raise fail(skip(pos + 1), "extra data after the closing ']'")
    return rows, where


def _parquet(path: Path, limit: int | None) -> tuple[list[dict], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[dict] = []
    try:
        for batch in pq.ParquetFile(path).iter_batches():
            rows.extend(batch.to_pylist())
            if limit is not None and len(rows) >= limit:
                rows = rows[:limit]
                break
    except (pa.ArrowException, UnicodeDecodeError) as err:
        raise DataFileError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    return rows, [f"{path}, row index {i}" for i in range(len(rows))]


def read_rows(path: Path, limit: int | None = None, max_row_bytes: int = MAX_ROW_BYTES,
              max_file_bytes: int = MAX_FILE_BYTES) -> tuple[list[dict], list[str]]:
    """The rows of one local file (.jsonl / .json: JSON Lines or a JSON array of objects; .parquet), at most
    `limit`, and where each one is; a DataFileError naming the place of the first problem. Bounded: a JSON Lines
    line above `max_row_bytes`, or a JSON array or parquet file above `max_file_bytes`, is refused unread."""
    kind = not_a_regular_file(path)
    if kind:
        raise DataFileError(f"{path}: {kind}, not a regular file; give a data file (.jsonl, .json or .parquet)")
    try:
        size = path.stat().st_size
        if path.suffix.lower() == ".parquet":
            if size > max_file_bytes:
                raise _too_big(path, size, max_file_bytes, "a parquet file", "task.max_file_bytes")
            return _parquet(path, limit)
        first, _ = _first_byte(path)
        if first == b"[":
            if size > max_file_bytes:
                raise _too_big(path, size, max_file_bytes, "a JSON array file (read whole)", "task.max_file_bytes")
            return _json_array(path, limit)
        return _json_lines(path, limit, max_row_bytes, max_file_bytes)
    except OSError as err:  # permission denied, a folder, ...: the OSError's own args[0] is only its errno
        raise DataFileError(f"{path}: cannot read the file ({err.strerror or err})") from None
