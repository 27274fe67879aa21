"""Whether a simulation's virtual devices train batched: `--batched auto|on|off`.

Stacking pays where a training step is cheap and Python's per-step overhead dominates; on a
compute-bound model the stacked step only adds copies. `auto` batches below a per-step cost
measured with `benchmarks/simulation_overhead.py` (see docs/benchmarks.md). Every virtual
device of a simulation runs the task's one model, so they share an architecture.
"""

from __future__ import annotations

import logging
from typing import Literal

from device_agent.batched.trainer import Batched

logger = logging.getLogger(__name__)

BatchedMode = Literal["auto", "on", "off"]
AUTO_MAX_STEP_MACS = 200_000
"""`auto` batches training steps of at most this many multiply-adds (`largest_step_macs` at the
round's batch size). Measured on the digits MLP at batch size 10, 50 devices, 5 rounds, one
worker, by hidden width (multiply-adds per step: batched speed-up of the whole run): 64 (47k:
1.7x), 256 (189k: 1.2x), 512 (379k: 1.0x), 1024 (758k: 0.83x), 4096 (3.0M: 0.58x)."""


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
