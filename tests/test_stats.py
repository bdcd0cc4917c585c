"""Means over seeds, their standard errors and the claims' verdict rules, against values worked out by hand."""

import math

import pytest

from smd_cli.stats import FAILS, HOLDS, INCONCLUSIVE, Cell, aggregate, at_least, at_most, cell, difference, greater, not_worse


def test_cell_is_the_mean_and_sample_standard_error():
    c = cell([0.1, 0.2, 0.3, None, float("nan"), "x"])  # non-numbers and NaN are left out
    assert (c.n, c.mean) == (3, pytest.approx(0.2))
    assert c.se == pytest.approx(0.1 / math.sqrt(3))  # sample std 0.1
    assert cell([0.5]) == Cell(0.5, None, 1) and cell([]) == Cell(None, None, 0)
    assert str(cell([0.1, 0.2, 0.3])) == "0.200 ± 0.058" and str(Cell(6.9e-6, None, 1)) == "6.9e-06" and str(cell([])) == "-"


def test_aggregate_groups_finished_runs():
    rows = [{"lam": "0.1", "status": "ok", "r": 0.1}, {"lam": "0.1", "status": "ok", "r": 0.3},
            {"lam": "0.8", "status": "failed", "r": None}, {"lam": "0.8", "status": "ok", "r": 0.5}]
    a, b = aggregate(rows, ["lam"], ["r"])
    assert (a["lam"], a["n"], a["runs"], a["r"]) == ("0.1", 2, 2, pytest.approx(0.2))
    assert a["r se"] == pytest.approx(0.1)  # std of (0.1, 0.3) = 0.1414, / sqrt 2
    assert (b["n"], b["runs"], b["r"], b["r se"]) == (1, 2, 0.5, None)


def test_paired_differences_by_hand():
    a, b = {"0": 0.9, "1": 0.5, "2": 0.7}, {"0": 0.8, "1": 0.3, "2": 0.65, "3": 0.1}  # seed 3 has no pair
    d = difference(a, b)  # 0.1, 0.2, 0.05: the warm starts' spread (0.5 to 0.9) cancels
    assert d.n == 3 and d.mean == pytest.approx(0.35 / 3)
    assert d.se == pytest.approx(math.sqrt(((0.1 - 0.35 / 3) ** 2 + (0.2 - 0.35 / 3) ** 2 + (0.05 - 0.35 / 3) ** 2) / 2 / 3))
    assert greater(d) == HOLDS  # 0.117 - 2 * 0.044 > 0, where unpaired cells (se 0.12 and 0.15) would be inconclusive


def test_verdicts_follow_the_written_rules():
    assert greater(Cell(0.4, 0.02, 3)) == HOLDS and greater(Cell(-0.4, 0.02, 3)) == FAILS
    assert greater(Cell(0.02, 0.028, 3)) == INCONCLUSIVE  # 0.02 - 0.056 < 0 < 0.02 + 0.056
    assert greater(Cell(0.4, None, 1)) == INCONCLUSIVE  # one seed proves nothing
    # parity within 0.05: d = -0.02, se 0.01: -0.02 - 0.02 = -0.04 >= -0.05 -> holds
    assert not_worse(Cell(-0.02, 0.01, 3), 0.05) == HOLDS
    assert not_worse(Cell(-0.1, 0.01, 3), 0.05) == FAILS  # -0.1 + 0.02 < -0.05
    assert not_worse(Cell(-0.04, 0.01, 3), 0.05) == INCONCLUSIVE
    assert at_most(Cell(1.04, 0.02, 3), 1.10) == HOLDS and at_most(Cell(1.2, 0.02, 3), 1.10) == FAILS
    assert at_most(Cell(1.09, 0.02, 3), 1.10) == INCONCLUSIVE and at_most(Cell(1.11, None, 1), 1.10) == FAILS
    assert at_least(Cell(0.3, 0.02, 3), 0.2) == HOLDS and at_least(Cell(0.05, 0.01, 3), 0.2) == FAILS
