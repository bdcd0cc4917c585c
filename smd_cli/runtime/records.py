"""Reading back what smd wrote (a run's `summary.json` and `metrics.jsonl`, a sweep member's records, a cached
evaluation): checked on every read, and a record that does not read back as it was written is named, never used; and
writing them (`write_json`, `write_jsonl`, `MetricsLog`): strict JSON through `smd_cli.runtime.integrity` (atomic,
never through a link), a non-finite number (NaN, inf) as `null` under its key, never as bare `NaN`, which is not JSON.

A rerun, a sweep and the report all decide from these records (a finished member is not run again; a resumed run
keeps the steps before its checkpoint; a table averages the summaries), so a damaged or edited one would silently
become a result. Every reader here raises `Damaged` (a ValueError) naming the file, the line or key, the value and
what was expected:

- `read_object(path)`: a JSON object (a bare NaN or Infinity, which is not JSON, reads as null: what smd writes for a
  non-finite number); a missing file is `{}` with `missing_ok`, else FileNotFoundError.
- `read_summary(path)`: `read_object` and `check_values`: every number finite, and the bounded ones in their range:
  anything under `eval/` (a task's metric, reward, exact match, answer-bearing KV kept, compression: all in [0, 1];
  a task's reward is in [0, 1] by `smd_cli.tasks.base.Task`'s contract), the sampler's `reward`, the `agreement/*`
  percentiles, `compression`, every `*kept*`, `*_frac*` and `*fraction*` value (in [0, 1]); seconds, bytes, lengths
  and standard errors at least 0; `steps` and `steps_run` whole numbers with `steps_run <= steps`.
- `read_metrics(path, through=N)`: one JSON object per line, each with an integer `step`, the steps strictly
  increasing, each row's values as `check_values` wants them, and with `through`, every step 1..N present (what a
  resume keeps: the steps up to its checkpoint). `torn_tail_ok` drops a last line cut short by a kill (no newline).
- `sealed(obj)` (written by `write_json`) / `read_sealed(path)`: a JSON object stored with the SHA-256 of its canonical text
  (the evaluation cache's entries), so that an entry changed since it was written is named, not read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from smd_cli.runtime.integrity import append_line, write_file

_UNIT = re.compile(r"(^|/)(reward|agreement/[a-z0-9]+|compression)(_mean|_max|_min)?$|kept|_frac|fraction|clipped_ratio")
_NON_NEGATIVE = re.compile(r"seconds|_s$|bytes|length|stderr|std$|_std|time|steps")
_WHOLE = ("steps", "steps_run")
_SLACK = 1e-9  # a mean of values in [0, 1] may read 1.0000000000000002


class Damaged(ValueError):
    """A record smd wrote that does not read back as written: unreadable, malformed, out of range, or changed."""


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_constant=lambda name: None)  # NaN, Infinity, -Infinity: no number
    except RecursionError:
        raise Damaged(f"{where}: nested too deeply to be a record smd wrote") from None
    except ValueError as err:  # JSONDecodeError included
        raise Damaged(f"{where}: not valid JSON ({getattr(err, 'msg', err)})") from None


def read_object(path: Path, missing_ok: bool = False) -> dict:
    """The JSON object in `path`; `Damaged` when it is not one ({} for a missing file with `missing_ok`)."""
    return _read(path, dict, missing_ok)


def read_list(path: Path, missing_ok: bool = False) -> list:
    """The JSON array in `path` (a history smd appends to); `Damaged` when it is not one ([] for a missing file with
    `missing_ok`)."""
    return _read(path, list, missing_ok)


def _read(path: Path, kind: type, missing_ok: bool):
    path = Path(path)
    if missing_ok and not path.exists():
        return kind()
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise Damaged(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    value = _parse(text, str(path))
    if not isinstance(value, kind):
        raise Damaged(f"{path}: holds a JSON {type(value).__name__}, not {'an object' if kind is dict else 'an array'}")
    return value


def _allowed(key: str, value) -> str | None:
    """What `value` of `key` must be, when it is not; None when it is fine."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return "a finite number"
    name = key.rsplit("/", 1)[-1]
    if key in _WHOLE or name in _WHOLE:
        return None if isinstance(value, int) and value >= 0 else "a whole number >= 0"
    if key.startswith("eval/") and not _NON_NEGATIVE.search(name) or _UNIT.search(key):
        return None if -_SLACK <= value <= 1 + _SLACK else "in [0, 1]"
    if _NON_NEGATIVE.search(name):
        return None if value >= 0 else ">= 0"
    return None


def check_values(record: dict, where: str) -> dict:
    """`record` when each of its bounded values is in range (see the module's docstring); `Damaged` naming the first
    that is not, with `where` (the file, or file:line)."""
    for key, value in record.items():
        wanted = _allowed(str(key), value)
        if wanted is not None:
            raise Damaged(f"{where}: {key}={json.dumps(value)} is out of range: a value of {key} is {wanted} "
                          "(changed since smd wrote it?)")
    steps, run = record.get("steps"), record.get("steps_run")
    if isinstance(steps, int) and isinstance(run, int) and run > steps:
        raise Damaged(f"{where}: steps_run={run} is more than steps={steps}")
    return record


def read_summary(path: Path, missing_ok: bool = False) -> dict:
    """A run's `summary.json` (or any summary record), checked (`check_values`)."""
    return check_values(read_object(path, missing_ok), str(path))


def read_metrics(path: Path, through: int | None = None, torn_tail_ok: bool = False) -> list[dict]:
    """The rows of a run's `metrics.jsonl`, checked line by line; with `through`, `Damaged` unless steps 1..`through`
    are all there (a resume's checkpoint at step `through` continues a log that must hold every step before it)."""
    path = Path(path)
    if not path.is_file():
        if through:
            raise Damaged(f"{path} is missing, but the run's checkpoint is at step {through}: its log of steps 1-{through} is gone")
        raise FileNotFoundError(f"{path}: no such file")
    lines = path.read_bytes().split(b"\n")
    rows: list[dict] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = _parse(line.decode("utf-8"), where)
        except (Damaged, UnicodeDecodeError) as err:
            if torn_tail_ok and n == len(lines):
                break  # no newline after it: a write a kill cut short
            raise Damaged(str(err) if isinstance(err, Damaged) else f"{where}: not UTF-8 text") from None
        if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
            raise Damaged(f"{where}: not a step's row (a JSON object with an integer 'step')")
        if rows and row["step"] <= rows[-1]["step"]:
            raise Damaged(f"{where}: step {row['step']} after step {rows[-1]['step']} (steps must increase)")
        rows.append(check_values(row, where))
    if through:
        missing = sorted(set(range(1, through + 1)) - {r["step"] for r in rows})
        if missing:
            raise Damaged(f"{path} lacks {len(missing)} of the {through} steps before the run's checkpoint (steps "
                          f"{_spans(missing)}): its statistics would be computed from {through - len(missing)} of them")
    return rows


def _spans(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    spans, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(spans)


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def sealed(body: dict) -> dict:
    """`body` with the SHA-256 of its canonical JSON: what a sealed record holds (`read_sealed`)."""
    return {"sha256": _digest(body), "body": body}


def read_sealed(path: Path) -> dict:
    """The body of a sealed record (`sealed`), `Damaged` when it is not one or changed since it was written."""
    record = read_object(path)
    body, digest = record.get("body"), record.get("sha256")
    if not isinstance(body, dict) or not isinstance(digest, str):
        raise Damaged(f"{path}: not a sealed record (a 'body' object and its 'sha256')")
    if _digest(body) != digest:
        raise Damaged(f"{path}: does not match its SHA-256 (changed since it was written)")
    return body


# Writing

def to_json(obj: Any, **kwargs) -> str:
    """`obj` as strict JSON: tensors as numbers or lists, paths as text, and NaN or infinity as null."""
    return json.dumps(plain(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: Any) -> None:
    write_file(path, to_json(obj, indent=2, sort_keys=True) + "\n")


def plain(x: Any) -> Any:
    """`x` in JSON's own types (non-finite floats: None); TypeError naming anything else."""
    if isinstance(x, dict):
        return {k if isinstance(k, str) else str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    if torch is not None and isinstance(x, torch.Tensor):
        return plain(x.item() if x.numel() == 1 else x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and getattr(x, "size", 2) == 1:  # a numpy scalar
        return plain(x.item())
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_jsonl(path: Path, torn_tail_ok: bool = False) -> list[dict]:
    """The rows of a jsonl file; a bad line is a ValueError naming the file and line. With `torn_tail_ok`, a
    last line without its newline that does not parse (a write cut short by a kill) is dropped instead."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    lines = path.read_bytes().split(b"\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            if torn_tail_ok and n == len(lines):
                break  # the file does not end with a newline: this line's write never finished
            raise ValueError(f"{path}:{n}: not a valid JSON line ({getattr(err, 'msg', err)})") from None
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_file(path, "".join(to_json(r) + "\n" for r in rows))


class MetricsLog:
    """One JSON line per step in `metrics.jsonl`, mirrored to TensorBoard (`tb/`)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, truncate_after: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if truncate_after is not None and self.path.exists():  # resuming: drop steps past the checkpoint
            kept = [r for r in read_jsonl(self.path, torn_tail_ok=True) if r.get("step", 0) <= truncate_after]
            write_jsonl(self.path, kept)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        append_line(self.path, to_json({"step": step, **metrics}), "the run's metrics.jsonl")  # never through a link
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
