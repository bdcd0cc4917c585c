"""Run directories: provenance, metrics (jsonl + TensorBoard), JSON that is always valid JSON, seeding.

Every file goes through `smd_cli.integrity` (atomic, its failures named). A non-finite number (NaN, inf) is
written as `null` under its key, never as bare `NaN`, which is not JSON."""

from __future__ import annotations

import json
import math
import platform
import random
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from smd_cli.integrity import append_line, write_file

PACKAGES = ("torch", "transformers", "tokenizers", "hydra-core", "datasets", "rouge-score", "rich", "safetensors", "smd")


def seed_everything(seed: int):
    """Seed Python and torch globally (for model init) and return a generator for sampling."""
    import torch  # here, so that the stages that only launch or read runs (smd ablate, its workers) never import it

    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def git_commit(repo: Path) -> str:
    """The commit of the code that ran, with `+dirty` when the work tree has changes."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    torch = sys.modules.get("torch")  # every stage that computes has loaded it; a sweep (`smd ablate`) never does
    versions["cuda"] = (torch.version.cuda or "none") if torch else "not loaded (this process ran no torch)"
    return versions


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


def write_provenance(run_dir: Path, config: dict, overrides: list[str], repo: Path, extra: dict | None = None) -> None:
    """The resolved config, the overrides, the git commit and package versions of a run (and `extra`: the world size)."""
    write_json(run_dir / "config.json", config)
    write_json(
        run_dir / "provenance.json",
        {"overrides": overrides, "argv": sys.argv, "git_commit": git_commit(repo), "versions": package_versions(), **(extra or {})},
    )


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
