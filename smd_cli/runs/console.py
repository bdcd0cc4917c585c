"""The console every stage prints to, and its two-column metric tables."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 140)  # logs and pipes: tables 140 columns wide, not 80


def print_metrics(title: str, summary: dict, keys, first_rows: tuple[tuple[str, str], ...] = ()) -> None:
    """A two-column rich table: `first_rows` as given, then each of `keys` present in `summary`."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for row in first_rows:
        table.add_row(*row)
    for key in keys:
        if isinstance(summary.get(key), (int, float)):
            table.add_row(key, f"{summary[key]:.4g}")
    console.print(table)
