"""Whether a simulation's virtual devices train batched: `--batched auto|on|off`.

Stacking pays where a training step is cheap and Python's per-step overhead dominates; on a
costly step it is slower than training device after device (measured below). Every virtual
device of a simulation runs the task's one model, so they share an architecture.
"""

from __future__ import annotations

import logging
from typing import Literal

from device_agent.batched.trainer import Batched

logger = logging.getLogger(__name__)

BatchedMode = Literal["auto", "on", "off"]
AUTO_MAX_STEP_MACS = 100_000
"""`auto` batches training steps of at most this many multiply-adds (`largest_step_macs` at the
round's batch size). Measured with `benchmarks/batched_overhead.py --threshold` (docs/
benchmarks.md) on the digits MLP at batch size 10, 50 devices, one worker, in two sweeps on a
shared machine: `--batched on` was 1.9x and 2.2x as fast as `off` at 47k multiply-adds a step,
but 1.2x and 0.96x at 189k, 0.73x and 1.3x at 379k, and slower in both from 758k up."""


def choose_trainer(mode: BatchedMode, step_macs: int) -> Batched | None:
    """A `Batched` trainer for the process's devices, or None to train each at once."""
    if mode == "off":
        return None
    if mode == "auto" and step_macs > AUTO_MAX_STEP_MACS:
        logger.info(
            "training per device: a step takes %d multiply-adds, above the %d batching pays "
            "below (--batched on forces it)",
            step_macs,
            AUTO_MAX_STEP_MACS,
        )
        return None
    return Batched()
