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
AUTO_MAX_STEP_MACS = 600_000
"""`auto` batches training steps of at most this many multiply-adds. Measured on the digits
MLP, 50 devices, 5 rounds, one worker, by hidden width (step multiply-adds: batched speed-up
of the whole run): 64 (152k: 1.7x), 256 (606k: 1.2x), 512 (1.2M: 1.0x), 1024 (2.4M: 0.83x),
4096 (9.7M: 0.58x); see docs/scaling.md."""


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
