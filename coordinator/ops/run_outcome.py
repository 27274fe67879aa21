"""The verdict on a finished run: a run whose every round was skipped did nothing, and says so."""

from __future__ import annotations

from collections.abc import Sequence

import typer
from rich.console import Console
from rich.markup import escape

from coordinator.engine.round_types import RoundRecord

ALL_SKIPPED_EXIT = 3
"""The exit status of a run that ended without changing the model."""


def all_skipped_warning(records: Sequence[RoundRecord]) -> str | None:
    """A warning when every round's aggregate was rejected (the model never moved), else None."""
    skipped = [r for r in records if r.scalars.get("aggregate_rejected")]
    if not records or len(skipped) < len(records):
        return None
    return (
        f"all {len(records)} round(s) were skipped: the guard rejected every aggregate (the log "
        "says by how much each moved the model), so the model is the initial one. The usual "
        "cause is unscaled inputs (features in the hundreds or thousands): scale them in the "
        "task, see docs/troubleshooting.md, 'Every round was skipped'"
    )


def exit_if_all_skipped(console: Console, records: Sequence[RoundRecord]) -> None:
    """Print the warning and exit with ALL_SKIPPED_EXIT if every round was skipped.

    Raises:
        typer.Exit: every round was skipped.
    """
    warning = all_skipped_warning(records)
    if warning is not None:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
        raise typer.Exit(ALL_SKIPPED_EXIT)
