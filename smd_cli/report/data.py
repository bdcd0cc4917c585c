"""What the report reads: the runs of each sweep (their swept values, summary and per-step metrics), grouped
into cells (mean and standard error over seeds) by any of their keys.

A sweep directory is what `smd ablate` wrote: `summary.json` with `runs` (one row per member: its swept
values, status, directory) and `sweep` (key -> values). Each member directory holds `summary.json` (the
held-out evaluations, `train/*` and `last/*`) and `metrics.jsonl` (one row per step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from smd_cli.io import read_jsonl
from smd_cli.stats import Cell, cell


@dataclass
class Run:
    values: dict[str, str]  # the swept values (task, algo, seed, ...)
    status: str
    error: str | None
    dir: Path
    summary: dict = field(default_factory=dict)
    _steps: list[dict] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def steps(self) -> list[dict]:
        """metrics.jsonl, read once ([] when missing or unreadable)."""
        if self._steps is None:
            try:
                self._steps = read_jsonl(self.dir / "metrics.jsonl")
            except (OSError, ValueError):
                self._steps = []
        return self._steps

    def metric(self, key: str):
        """A summary key, or a statistic of the per-step metrics: `steps:KEY:mean`, `steps:KEY:last10`."""
        if not key.startswith("steps:"):
            return self.summary.get(key)
        _, name, how = key.split(":")
        values = [r[name] for r in self.steps() if isinstance(r.get(name), (int, float))]
        if how == "last10":
            values = values[-10:]
        return sum(values) / len(values) if values else None


@dataclass
class Sweep:
    name: str
    dir: Path
    keys: list[str]  # swept keys, in the sweep's order
    runs: list[Run]

    @classmethod
    def read(cls, name: str, directory: Path) -> "Sweep":
        summary = json.loads((directory / "summary.json").read_text())
        keys = list(summary["sweep"])
        runs = []
        for row in summary["runs"]:
            run_dir = Path(row["dir"])
            if not run_dir.is_absolute():
                run_dir = directory / run_dir
            member = _json(run_dir / "summary.json") if row["status"] == "ok" else {}
            runs.append(Run({k: str(row[k]) for k in keys}, row["status"], row.get("error"), run_dir, member))
        return cls(name, directory, keys, runs)

    def values(self, key: str) -> list[str]:
        """The values of a swept key, in the sweep's order."""
        return list(dict.fromkeys(r.values[key] for r in self.runs))

    def select(self, **values) -> list[Run]:
        return [r for r in self.runs if all(r.values.get(k) == str(v) for k, v in values.items())]

    def cell(self, metric: str, **values) -> Cell:
        """Mean and standard error of `metric` over the finished runs with these swept values (the seeds)."""
        return cell(r.metric(metric) for r in self.select(**values) if r.ok)

    def by_seed(self, metric: str, **values) -> dict[str, float]:
        """`metric` of each finished run with these swept values, by its seed (for paired comparisons)."""
        return {r.values.get("seed", ""): r.metric(metric) for r in self.select(**values) if r.ok and r.metric(metric) is not None}

    def seeds(self) -> list[str]:
        return self.values("seed") if "seed" in self.keys else []


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
