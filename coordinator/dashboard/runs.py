"""Other runs next to the one a dashboard follows, for its charts' overlay.

A run directory's siblings that hold a metrics.jsonl (e.g. `runs/a`, `runs/b` beside
`runs/c`) are listed by name; each is read only when the page asks for it, and only its rounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from coordinator.dashboard.feeds import read_rounds

MAX_RUNS: Final = 50
"""Sibling runs listed at most (by name), so a crowded folder stays cheap to list."""


class RunLibrary:
    """The runs beside `directory` (itself left out)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def names(self) -> list[str]:
        """Sibling directories with a metrics.jsonl, sorted, at most MAX_RUNS."""
        parent = self.directory.resolve().parent
        try:
            entries = sorted(parent.iterdir())
        except OSError:
            return []
        own = self.directory.resolve().name
        found = [p.name for p in entries if p.name != own and (p / "metrics.jsonl").is_file()]
        return found[:MAX_RUNS]

    def rounds(self, name: str) -> list[dict[str, Any]] | None:
        """The rounds of sibling run `name`, JSON-ready; None if it is not one of `names()`."""
        if name not in self.names():
            return None
        path = self.directory.resolve().parent / name / "metrics.jsonl"
        return [r.model_dump(mode="json") for r in read_rounds(path)]
