"""Every device's minibatches of a phase, laid out once as index tensors for the stacked steps.

Each device draws its shuffles from its own generator exactly as `device_agent.training.train`
does through `minibatches` (one `randperm` per epoch it starts, including the epoch whose first
batch only ends the loop at `max_steps`), so its trajectory and the generator's state afterwards
are the per-device path's. The layout is computed without a Python loop over steps: one gather
per step then feeds every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from device_agent.training import TrainSpec


@dataclass(frozen=True)
class Schedule:
    """A phase's minibatches for D devices: S steps of at most B samples each."""

    index: torch.Tensor
    """[S, D, B] sample positions into the devices' concatenated splits (padding: own first)."""
    mask: torch.Tensor
    """[S, D, B] bool: which positions are real samples."""
    steps: list[int]
    """Each device's number of steps (its steps are the first ones)."""
    samples: list[int]
    """Each device's number of samples over its steps."""

    @property
    def active(self) -> torch.Tensor:
        """[S, D] bool: devices still training at each step."""
        steps = torch.tensor(self.steps)
        return torch.arange(self.index.shape[0]).unsqueeze(1) < steps.unsqueeze(0)


@dataclass(frozen=True)
class _Plan:
    epochs_drawn: int
    steps: int
    positions: np.ndarray
    """Where each kept element of the device's concatenated shuffles goes in its [S*B] rows."""


@lru_cache(maxsize=4096)
def _plan(count: int, batch: int, epochs: int, max_steps: int | None) -> _Plan:
    """One device's draws and layout: depends only on its size and the phase's settings."""
    if count == 0 or epochs <= 0:
        return _Plan(0, 0, np.zeros(0, dtype=np.int64))
    per_epoch = math.ceil(count / batch)
    total = epochs * per_epoch
    steps = total if max_steps is None else min(total, max_steps)
    yielded = total if max_steps is None else min(total, max_steps + 1)
    element = np.arange(count)
    rows = [
        (epoch * per_epoch + element // batch) * batch + element % batch
        for epoch in range(math.ceil(yielded / per_epoch))
    ]
    positions = np.concatenate(rows)
    return _Plan(len(rows), steps, positions[positions < steps * batch])


def schedule(
    counts: Sequence[int], spec: TrainSpec, generators: Sequence[torch.Generator]
) -> Schedule:
    """Draw every device's shuffles for `spec` and lay its minibatches out step by step."""
    plans = [
        _plan(count, spec.batch_size, spec.epochs, spec.max_steps) if spec.trainable else _NONE
        for count in counts
    ]
    devices, batch = len(counts), spec.batch_size
    width = max((p.steps for p in plans), default=0) * batch
    draws: list[torch.Tensor] = []
    kept: list[np.ndarray] = []
    for count, plan, generator in zip(counts, plans, generators, strict=True):
        for _ in range(plan.epochs_drawn):
            draws.append(torch.randperm(count, generator=generator))
        keep = np.zeros(plan.epochs_drawn * count, dtype=bool)
        keep[: len(plan.positions)] = True
        kept.append(keep)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    last = max(int(sum(counts)) - 1, 0)
    index = np.repeat(np.minimum(offsets, last), width)
    mask = np.zeros(devices * width, dtype=bool)
    if draws:
        lengths = [len(p.positions) for p in plans]
        rows = np.repeat(np.arange(devices, dtype=np.int64) * width, lengths)
        where = np.concatenate([p.positions for p in plans]) + rows
        drawn = torch.cat(draws).numpy()[np.concatenate(kept)]
        index[where] = drawn + np.repeat(offsets, lengths)
        mask[where] = True
    steps = width // batch if batch else 0
    return Schedule(
        index=torch.from_numpy(index).view(devices, steps, batch).transpose(0, 1).contiguous(),
        mask=torch.from_numpy(mask).view(devices, steps, batch).transpose(0, 1).contiguous(),
        steps=[p.steps for p in plans],
        samples=[len(p.positions) for p in plans],
    )


_NONE = _Plan(0, 0, np.zeros(0, dtype=np.int64))
