"""The per-algorithm batched benchmark covers every local update that trains stacked."""

from __future__ import annotations

from benchmarks.batched_algorithms import ALGORITHMS
from device_agent.algorithms import LOCAL_UPDATES


def test_every_update_that_stacks_has_a_row() -> None:
    stacking = {
        name
        for name, update in LOCAL_UPDATES.items()
        if hasattr(update, "batch_phases") or hasattr(update, "run_stacked")
    }
    assert stacking == set(ALGORITHMS)
