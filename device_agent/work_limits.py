"""A device's own ceiling on the work one round may ask of it.

Whatever an announcement says, an agent will not pin its CPU for good: it declines a round whose
config asks for more epochs or steps than its ceilings before starting, and stops (declining,
with the reason) a round that runs past its step or time ceiling. The coordinator then stops
waiting for it. Simulation's virtual devices run without ceilings: their coordinator is the user.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocols.errors import TrainingError


@dataclass(frozen=True)
class WorkLimits:
    """Ceilings per round; each documented with its `pfl-agent start` flag."""

    max_epochs: int = 100
    """The most passes any `*_epochs` setting of an announcement may ask for."""
    max_steps: int = 100_000
    """The most optimizer steps in one round, over all its phases (and any `*_steps` setting)."""
    max_seconds: float = 3600.0
    """The longest one round's local work may run."""


class WorkLimitError(TrainingError):
    """A round asks for, or has done, more work than the device's ceilings allow."""


def config_problem(config: Mapping[str, Any], limits: WorkLimits) -> str | None:
    """Why an announced algorithm config asks for too much work, or None.

    Every integer setting named `..._epochs` counts against `max_epochs`, every `..._steps`
    against `max_steps` (a product such as pFedBreD's local x prox steps is caught while
    running).
    """
    for name, value in sorted(config.items()):
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if name.endswith("epochs") and value > limits.max_epochs:
            return f"{name}={value} is above this device's ceiling of {limits.max_epochs} epochs"
        if name.endswith("steps") and value > limits.max_steps:
            return f"{name}={value} is above this device's ceiling of {limits.max_steps} steps"
    return None


class WorkMeter:
    """Counts one round's optimizer steps and time against the ceilings; raises past either."""

    def __init__(self, limits: WorkLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.steps = 0
        self._clock = clock
        self._started = clock()

    def tick(self) -> None:
        """One optimizer step done.

        Raises:
            WorkLimitError: the round went past its step or time ceiling.
        """
        self.steps += 1
        if self.steps > self.limits.max_steps:
            msg = f"the round passed this device's ceiling of {self.limits.max_steps} steps"
            raise WorkLimitError(msg)
        elapsed = self._clock() - self._started
        if elapsed > self.limits.max_seconds:
            msg = (
                f"the round's local work passed this device's ceiling of "
                f"{self.limits.max_seconds:g} s ({elapsed:.0f} s, {self.steps} steps)"
            )
            raise WorkLimitError(msg)
