"""The paper's claims across tasks: `ACROSS_TASKS.md` and `across_tasks.csv` from each task's `claims.csv`.

A row per claim and view, a column per task, each cell the task's verdict with its paired difference (mean ± se over
seeds); below it, the claims whose verdict differs between tasks (decided both ways, or decided on some tasks and not
on others) and how many dense-cache verdicts each task could decide at all (a task whose dense cache answers every
prompt decides none of them). Every cell is read from a report that `smd reproduce` wrote; nothing is judged here.
"""

from __future__ import annotations

import csv
from pathlib import Path

from smd_cli.report.claims import FIXED, UNINFORMATIVE
from smd_cli.report.stats import FAILS, HOLDS
from smd_cli.report.write import Report

NOT_RUN = "not run"


def verdicts(report_dir: Path) -> dict[tuple[str, str], dict]:
    """A task's verdicts (its claims.csv) by (claim, view)."""
    with (report_dir / "claims.csv").open(newline="") as f:
        return {(row["claim"], row["view"]): row for row in csv.DictReader(f)}


def cell(row: dict | None) -> str:
    """'holds, +0.247 ± 0.026 (5 seeds)'; the verdict alone where it has no paired difference."""
    if row is None:
        return NOT_RUN
    if not row["seeds"] or row["d"] in ("", "-") or row["verdict"] in UNINFORMATIVE:
        return row["verdict"]
    return f"{row['verdict']}, {float(row['d']):+.3f} ± {float(row['se']):.3f} ({row['seeds']} seeds)"


def changes(found: dict[str, dict[tuple[str, str], dict]], key: tuple[str, str]) -> str | None:
    """How the verdict on `key` differs between the tasks that judged it ('both ways', 'decided on some'), or None."""
    seen = {task: rows[key]["verdict"] for task, rows in found.items() if key in rows}
    if len(set(seen.values())) < 2:
        return None
    decided = {v for v in seen.values() if v in (HOLDS, FAILS)}
    if decided == {HOLDS, FAILS}:
        return "both ways: " + "; ".join(f"{v} on {', '.join(t for t in seen if seen[t] == v)}" for v in (HOLDS, FAILS))
    return "decided on some: " + "; ".join(f"{t}: {v}" for t, v in seen.items())


def write_across(out: Path, reports: dict[str, Path], commands: dict[str, str]) -> Path:
    """OUT/ACROSS_TASKS.md (and across_tasks.csv) from each task's report folder (`reports`: task -> folder), with the
    command that re-runs each (`commands`)."""
    found = {task: verdicts(folder) for task, folder in reports.items()}
    keys = list(dict.fromkeys(k for rows in found.values() for k in rows))
    r = Report(out)
    r.text("# The paper's claims across tasks", "Each column is one task's `smd reproduce` report (its verdicts, with "
           "the verdict rule written there: paired over seeds, seeds added until decided); a cell gives the verdict and the "
           "paired difference a - b, mean ± se over seeds. `not run`: the task's reproduction has no table for the claim.")
    r.text(*(f"- **{task}**: `{folder / 'REPORT.md'}`, re-run with `{commands[task]}`" for task, folder in reports.items()))
    fixed = [t for t, rows in found.items() if any(row["prompts"] == FIXED for row in rows.values())]
    if fixed:
        r.text(f"Verdicts of {', '.join(fixed)} rest (in part) on runs that evaluated the same fixed held-out prompts for every "
               "seed: they are about those prompts, not the task (the task's report names which).")
    r.table("across_tasks", ["claim", "view", *reports], [[claim, view or "-", *(cell(found[t].get((claim, view))) for t in reports)]
                                                         for claim, view in keys])
    differ = [(k, how) for k in keys if (how := changes(found, k))]
    r.text("## Where the verdict changes between tasks",
           *([f"- {claim}{f' ({view})' if view else ''}: {how}" for (claim, view), how in differ]
             or ["No verdict differs between the tasks."]))
    lines = []
    for task, rows in found.items():
        dense = [row for (_, view), row in rows.items() if view == "dense cache"]
        informative = sum(row["verdict"] not in UNINFORMATIVE for row in dense)
        lines.append(f"- {task}: {informative} of {len(dense)} dense-cache verdicts informative")
    r.text("## Dense-cache verdicts a ceiling cannot decide", "A verdict is uninformative when every run of both cells sits at "
           "the reward's bound (the dense cache answers every prompt): no seed count decides it.", *lines)
    return r.save("ACROSS_TASKS.md")
