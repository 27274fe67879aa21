"""The one line `serve` says per round, so a log shows progress without the progress bar."""

from __future__ import annotations

import math

from coordinator.engine.round_types import RoundRecord


def round_line(record: RoundRecord, total: int) -> str:
    """E.g. `round 3 of 30: 2 of 2 selected answered, loss 0.5379, 1.2 s`."""
    loss = record.train_loss
    shown = f"loss {loss:.4f}" if math.isfinite(loss) else "loss not reported"
    parts = [
        f"round {record.round_id} of {total}: "
        f"{record.participants} of {record.selected} selected answered",
        shown,
        f"{record.wall_seconds:.1f} s",
    ]
    if record.scalars.get("aggregate_rejected"):
        parts.append("skipped: the model is unchanged")
    return ", ".join(parts)
