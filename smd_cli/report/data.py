"""What the report reads: the runs of each sweep (their swept values, summary and per-step metrics), grouped
into cells (mean and standard error over seeds) by any of their keys, and paired seed by seed.

A sweep directory is what `smd ablate` wrote: `summary.json` with `runs` (one row per member: its swept
values, status, directory) and `sweep` (key -> values). A table of `smd reproduce` may be several such
directories (the recipe's own seeds, then the seeds added until its claims were decided): their rows are merged,
a later row replacing an earlier one of the same swept values. Each member directory holds `summary.json` (the
held-out evaluations, `train/*` and `last/*`) and `metrics.jsonl` (one row per step). A run whose policy
collapsed (status "collapsed", `status_reason`) has results like a completed one and is flagged; a failed run
(diverged, parity broken, or stopped by an error: `Run.failed`) has none, and its summary is read only for why
(`Run.ended`); where a comparison asks for it, it counts as the metric's worst value (`by_seed(failed=...)`).
Each run's summary says which weights ran (`model/weights`): `model.source=auto` takes a Hub checkpoint
when the Hub is reachable or cached and the dequantised GGUF otherwise, so runs of one table can differ by the
network; `check_weights` refuses to pool or pair such runs (only a swept `model` key may tell them apart).
Every record is read through `smd_cli.runtime.records`: one that is damaged or out of range (a summary's `eval/reward_after=5.0`,
a bad line of a member's `metrics.jsonl`) stops the report with `records.Damaged` naming it; it is never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from smd_cli.report.stats import USABLE, Cell, cell
from smd_cli.runtime import records


@dataclass
class Run:
    values: dict[str, str]  # the swept values (task, algo, seed, ...)
    status: str  # ok | collapsed | failed ... | not run (a planned run, no directory yet)
    error: str | None  # why it failed, or why it collapsed
    dir: Path
    summary: dict = field(default_factory=dict)
    _steps: list[dict] | None = None

    @property
    def ok(self) -> bool:
        """It has held-out results: completed, or collapsed (an outcome of the algorithm on that seed)."""
        return self.status in USABLE

    @property
    def collapsed(self) -> bool:
        return self.status == "collapsed"

    @property
    def attempted(self) -> bool:
        return self.status != "not run"

    @property
    def failed(self) -> bool:
        """It ran and ended without results: diverged, parity broken, or stopped by an error."""
        return self.attempted and not self.ok

    @property
    def ended(self) -> str:
        """How a failed run ended, in a few words: its training summary's status (diverged, parity_broken) and reason, or
        the sweep's reason (an error, a signal)."""
        status = self.summary.get("status")
        why = " ".join(str(self.summary.get("status_reason") or self.error or "").split())
        why = why if len(why) <= 120 else why[:117] + "..."
        head = status if status and status != "completed" else "failed"
        return f"{head}: {why}" if why else head

    @property
    def weights(self) -> str | None:
        """Which weights ran (`model/weights` of its summary: e.g. the Hub checkpoint, or a dequantised GGUF); None
        when it has no results or its summary does not say."""
        return self.summary.get("model/weights") if self.ok else None

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.values.items())

    def steps(self) -> list[dict]:
        """metrics.jsonl, read once and checked (`smd_cli.runtime.records.read_metrics`: a damaged line is `records.Damaged`
        naming the file and line, never a column left blank); [] when the run has none."""
        if self._steps is None:
            path = self.dir / "metrics.jsonl"
            self._steps = records.read_metrics(path) if path.is_file() else []
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


def seed_key(seed: str):
    """Seeds in numeric order (0, 1, 2, ..., 10), other labels after them."""
    return (0, int(seed), "") if str(seed).lstrip("-").isdigit() else (1, 0, str(seed))


@dataclass
class Sweep:
    name: str
    dir: Path
    keys: list[str]  # swept keys, in the sweep's order
    runs: list[Run]

    @classmethod
    def read(cls, name: str, directory: Path, more: list[Path] = ()) -> "Sweep":
        """The sweep `smd ablate` wrote in `directory`, with the rows of the sweeps in `more` merged in (same keys)."""
        keys: list[str] = []
        rows: dict[tuple, Run] = {}
        for where in (directory, *more):
            summary = records.read_object(where / "summary.json")
            keys = keys or list(summary["sweep"])
            for row in summary["runs"]:
                run_dir = Path(row["dir"])
                if not run_dir.is_absolute():
                    run_dir = where / run_dir
                status = row["status"]
                member = (records.read_summary(run_dir / "summary.json", missing_ok=True) if status in USABLE
                          else _how_it_ended(run_dir) if status != "not run" else {})
                reason = row.get("status_reason") or row.get("error")
                values = {k: str(row[k]) for k in keys}
                rows[tuple(values.values())] = Run(values, status, reason, run_dir, member)
        return cls(name, directory, keys, list(rows.values()))

    def values(self, key: str) -> list[str]:
        """The values of a swept key, in the sweep's order (seeds in numeric order)."""
        found = list(dict.fromkeys(r.values[key] for r in self.runs))
        return sorted(found, key=seed_key) if key == "seed" else found

    def select(self, **values) -> list[Run]:
        return [r for r in self.runs if all(r.values.get(k) == str(v) for k, v in values.items())]

    def cell(self, metric: str, seeds=None, failed: float | None = None, **values) -> Cell:
        """Mean and standard error of `metric` over the runs with results with these swept values (the seeds; only
        `seeds` when given); a failed run counts as `failed` when given."""
        runs = [r for r in self.select(**values) if seeds is None or r.values.get("seed") in seeds]
        return cell(r.metric(metric) if r.ok else failed if r.failed else None for r in runs)

    def by_seed(self, metric: str, failed: float | None = None, **values) -> dict[str, float]:
        """`metric` of each run with results with these swept values, by its seed (for paired comparisons); with
        `failed` (the metric's worst value: the report's rule), a failed run's seed too, at that value."""
        out = {}
        for r in self.select(**values):
            value = r.metric(metric) if r.ok else failed if r.failed else None
            if value is not None:
                out[r.values.get("seed", "")] = value
        return out

    def failures(self, **values) -> list[Run]:
        """The failed runs with these swept values."""
        return [r for r in self.select(**values) if r.failed]

    def attempted(self, **values) -> set[str]:
        """The seeds of the runs with these swept values that ran (with results or failed)."""
        return {r.values.get("seed", "") for r in self.select(**values) if r.attempted}

    def paired(self, metric: str, a: dict, b: dict, failed: float | None = None) -> tuple[list[str], list[float | None]]:
        """The per-seed differences a - b of `metric`, in seed order, over the seeds both cells ran (None where either
        has no value: a failed run without `failed`, a run without the metric), as `stats.sequential` reads them; and
        those seeds. `failed`: the value a failed run counts as (the metric's worst)."""
        seeds = sorted(self.attempted(**a) & self.attempted(**b), key=seed_key)
        va, vb = self.by_seed(metric, failed, **a), self.by_seed(metric, failed, **b)
        return seeds, [va[s] - vb[s] if s in va and s in vb else None for s in seeds]

    def seeds(self) -> list[str]:
        return self.values("seed") if "seed" in self.keys else []


def _how_it_ended(run_dir: Path) -> dict:
    """A failed run's summary, read only for how it ended (`Run.ended`: its status and reason; its numbers are never
    used); {} when it is missing or unreadable (the sweep's own reason then says why it failed)."""
    try:
        return records.read_object(run_dir / "summary.json", missing_ok=True)
    except (records.Damaged, OSError):
        return {}


class WeightsDiffer(ValueError):
    """Runs that a report would pool or pair ran different weights."""


def check_weights(sweeps: dict[str, Sweep], shown: int = 3) -> None:
    """Raise `WeightsDiffer` when runs with results that the report compares ran different weights: all the runs of
    all the sweeps, or, in a sweep that sweeps a `model` key, those with the same model values. Runs whose summary
    does not say are not judged. The message names each weights with (up to `shown` of) its runs."""
    groups: dict[tuple, dict[str, list[str]]] = {}
    for name, sweep in sweeps.items():
        model_keys = [k for k in sweep.keys if k == "model" or k.startswith("model.")]
        for run in sweep.runs:
            if run.weights:
                group = tuple(f"{k}={run.values[k]}" for k in model_keys)
                groups.setdefault(group, {}).setdefault(run.weights, []).append(f"{name}: {run.label}")
    for group, found in groups.items():
        if len(found) > 1:
            named = "; ".join(f"{label!r} in {len(runs)} run{'s' * (len(runs) > 1)} ({', '.join(runs[:shown])}"
                              f"{', ...' if len(runs) > shown else ''})" for label, runs in found.items())
            raise WeightsDiffer(f"the runs{' of ' + ','.join(group) if group else ''} ran different weights, and a report does not "
                                f"pool or pair them: {named}. model.source=auto loads the Hub's checkpoint when the Hub is reachable "
                                "or cached, and the dequantised GGUF otherwise: set model.source=hub or model.source=gguf, and run "
                                "the runs of the other weights again (remove their directories)")
