"""benchmarks/robustness.py: its table sets every cell against the clean default run."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import write_section
from benchmarks.robustness import AGGREGATORS, FRACTIONS, MARKER, REFERENCE, Cell, render_section


def test_the_section_has_every_cell_and_its_change_from_the_clean_default(tmp_path: Path) -> None:
    clean = Cell(0.9, 0.8, 1.0)
    results = {("sync", a, "none", 0.0): clean for a in AGGREGATORS}
    results |= {
        ("sync", a, "sign-flip", f): Cell(0.85, 0.5 + f, 1.0)
        for a in AGGREGATORS
        for f in FRACTIONS
    }
    results["sync", "median", "none", 0.0] = Cell(0.7, 0.6, 1.0)
    section = render_section(results, ["sign-flip"], ["sync"], 0, "python -m benchmarks.robustness")
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0] == "| attack | liars | " + " | ".join(AGGREGATORS) + " |"
    clean_row = rows[1].split(" | ")
    assert clean_row[2 + list(AGGREGATORS).index(REFERENCE)] == "0.900 / 0.800 (+0.0 / +0.0)"
    assert clean_row[2 + list(AGGREGATORS).index("median")] == "0.700 / 0.600 (-20.0 / -20.0)"
    assert rows[2].startswith("| sign-flip | 10% | 0.850 / 0.600 (-5.0 / -20.0)")
    assert rows[3].startswith("| sign-flip | 25% | 0.850 / 0.750 (-5.0 / -5.0)")
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nkept\n")
    write_section(doc, section, MARKER)
    write_section(doc, section, MARKER)  # a rerun replaces its own section
    assert doc.read_text().count(MARKER) == 2
    assert "kept" in doc.read_text()
