"""A run's summary: the one record `simulate` and `serve` produce and write as summary.json."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final

SUMMARY_JSON: Final = "summary.json"
FleetMetrics = Mapping[str, float | None]
"""`summarize_evaluations`' fleet metrics (personalized_mean, ..., global)."""
PersonalizationEffect = Mapping[str, float | int]
"""`personalization_effect`'s counts of devices personalization helped and hurt."""

_SIMULATION_ONLY: Final = frozenset(
    {"stateless", "partition", "alpha", "export", "privacy", "sim_seconds", "stop_reason"}
)
"""Keys summary.json has only when they apply: a simulation's split, `export` only with
--export-dir, `privacy` only under differential privacy, `sim_seconds` on a simulated clock,
`stop_reason` only when the run stopped early."""


@dataclass(frozen=True)
class RunSummary(Mapping[str, Any]):
    """What a finished run reports, read by attribute.

    It is also a read-only mapping over `as_json()`, so code that reads either a live run or a
    summary.json from disk (compare's columns, benchmark caches) reads both the same way.
    """

    algorithm: str
    task: str
    metric_name: str
    devices: int
    rounds: int
    pretrain_rounds: int
    seed: int
    participation: float
    metrics: FleetMetrics | None
    personalization: PersonalizationEffect | None
    wall_seconds: float
    bytes_up: int
    bytes_down: int
    rejected_messages: int
    config: Mapping[str, Any]
    stateless: bool | None = None
    partition: str | None = None
    alpha: float | None = None
    export: Mapping[str, Any] | None = None
    privacy: Mapping[str, Any] | None = None
    """Under DP: the guarantee the run's released models carry (epsilon at delta, settings)."""
    sim_seconds: float | None = None
    """On a simulated clock: the simulated time the run took."""
    stop_reason: str | None = None
    """Why the run stopped early (the privacy budget, every round skipped); None if it did not."""

    def as_json(self) -> dict[str, Any]:
        """The summary.json document; a simulation-only key that is None is left out."""
        document = {field.name: getattr(self, field.name) for field in fields(self)}
        return {
            key: value
            for key, value in document.items()
            if value is not None or key not in _SIMULATION_ONLY
        }

    def write(self, out_dir: Path) -> Path:
        """Write `out_dir/summary.json` (keys sorted, indented) and return its path."""
        path = out_dir / SUMMARY_JSON
        path.write_text(json.dumps(self.as_json(), indent=2, sort_keys=True))
        return path

    def __getitem__(self, key: str) -> Any:
        """The value summary.json holds under `key`."""
        return self.as_json()[key]

    def __iter__(self) -> Iterator[str]:
        """The keys summary.json holds."""
        return iter(self.as_json())

    def __len__(self) -> int:
        """How many keys summary.json holds."""
        return len(self.as_json())
