"""benchmarks/fast_liar.py: its table holds each column's mean over the seeds."""

from __future__ import annotations

from benchmarks.fast_liar import ATTACKS, COLUMNS, MARKER, Cell, render_section


def test_each_cell_is_the_mean_over_the_seeds_with_its_simulated_seconds() -> None:
    cells = {
        (attack, column): [Cell(0.9, 0.8, 10.0), Cell(0.7, 0.4, 20.0)]
        for attack in ATTACKS
        for column in COLUMNS
    }
    cells["sign-flip", "--fair-share 0 (before)"] = [Cell(0.5, 0.1, 12.0), Cell(0.6, 0.3, 14.0)]
    section = render_section(cells, [0, 1])
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0] == "| liar (the fastest of 10) | " + " | ".join(COLUMNS) + " |"
    assert rows[1] == "| none | " + " | ".join(["0.800 / 0.600 (15.0 s)"] * len(COLUMNS)) + " |"
    assert rows[2].startswith("| sign-flip | 0.550 / 0.200 (13.0 s) | 0.800 / 0.600 (15.0 s)")
    assert section.count(MARKER) == 2
    assert "--seeds 0,1" in section
