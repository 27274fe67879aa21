"""Plan local training to fit a memory budget: the largest micro-batch that fits, or a refusal.

The peak of one local update is modelled as (spec partial-personalization.md §4.1, §4.3)

    M(b) = R + B * (3|w| + 6|u| + 5|v|) + B_opt + b * A_1

R is the process's resident memory when planning (Python, torch, data). The spec's 3|u| + 2|v|
(broadcast copy, working copy and gradients) is where the formula starts; what an agent really
holds at its peak, measured in benchmarks/memory.py, is more: the decoded broadcast of the whole
model w, the workspace and allocator slack (3|w|); per shared tensor its gradient, the snapshot
and the delta, and three copies while the delta is serialized and framed (6|u|); per personal
tensor the stored copy, its gradient, the snapshot and two copies while it is saved (5|v|).
B_opt is the optimizer state (momentum) and A_1 the memory one more sample adds to a step.

A_1 comes from a probe where Linux lets us measure it: two real forward/backward passes at two
micro-batch sizes, each with the kernel's peak counter reset, and the slope between them (this
catches backward temporaries and matmul workspaces that no formula lists). Elsewhere it is
estimated as 3x the bytes autograd saves for backward, counted exactly with saved-tensor hooks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import psutil
import torch
from torch import nn

from pfl_tasks.base import Split, Task
from pfl_tasks.split import ParamSplit
from protocols.errors import MemoryBudgetError
from protocols.messages import MemoryPlan

_UNITS: Final = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 2**10, "m": 2**20, "g": 2**30,
}  # fmt: skip
_BUDGET_PATTERN: Final = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*|%)\s*$")
SAFETY_MARGIN: Final = 0.1
"""Fraction of the budget above the runtime kept free for allocator slack and stray temporaries."""


def parse_memory_budget(text: str, available_bytes: int) -> int:
    """Bytes from "512MB", "1.5GiB", "70%" or a fraction such as "0.5" of `available_bytes`.

    Raises:
        ValueError: the text is not a size, a percentage or a fraction in (0, 1].
    """
    match = _BUDGET_PATTERN.match(text)
    if match is None:
        msg = f"invalid memory budget {text!r}: use e.g. 512MB, 1.5GiB, 70% or 0.5"
        raise ValueError(msg)
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%" or (unit == "" and number <= 1):
        fraction = number / 100 if unit == "%" else number
        if not 0 < fraction <= 1:
            msg = f"memory budget fraction must be in (0, 1], got {text!r}"
            raise ValueError(msg)
        return int(available_bytes * fraction)
    if unit not in _UNITS:
        msg = f"unknown unit in memory budget {text!r}; use B, KB, MB, GB, KiB, MiB or GiB"
        raise ValueError(msg)
    return int(number * _UNITS[unit])


def current_rss_bytes() -> int:
    """Resident memory of this process now."""
    return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class MemoryModel:
    """The terms of M(b), in bytes."""

    runtime_bytes: int
    parameter_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: int
    method: Literal["estimate", "probe"] = "estimate"

    def peak(self, micro_batch: int) -> int:
        """M(b) for a micro-batch of `micro_batch` samples."""
        return (
            self.runtime_bytes
            + self.parameter_bytes
            + self.optimizer_bytes
            + micro_batch * self.activation_bytes_per_sample
        )


def activation_bytes_per_sample(
    model: nn.Module, task: Task, data: Split, probe_batch: int = 4
) -> int:
    """Bytes autograd keeps for backward per sample, counted on a probe forward pass.

    Parameters saved for backward are excluded (they are counted as parameters); a batch of
    `probe_batch` rather than 1 averages out per-batch constants.
    """
    count = max(1, min(probe_batch, len(data)))
    parameter_pointers = {p.data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        pointer = tensor.data_ptr()
        if pointer not in parameter_pointers and pointer not in seen:
            seen.add(pointer)
            saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = model(data.inputs[:count])
        loss = task.loss(outputs, data.targets[:count])
    saved += outputs.numel() * outputs.element_size() + loss.numel() * loss.element_size()
    del loss, outputs
    return math.ceil(float(saved) / count)


_CLEAR_REFS: Final = Path("/proc/self/clear_refs")
_STATUS: Final = Path("/proc/self/status")
ESTIMATE_FACTOR: Final = 3
"""Saved activations plus their gradients plus the pre-activation temporaries, per sample."""


def _peak_rss_bytes() -> int | None:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def probe_bytes_per_sample(
    model: nn.Module, task: Task, data: Split, sizes: tuple[int, int] = (8, 128)
) -> int | None:
    """Measured memory per sample of a training step, or None where it cannot be measured.

    Gradients are left as they were (zeroed afterwards), parameters are not stepped.
    """
    small, large = min(sizes[0], len(data)), min(sizes[1], len(data))
    if large <= small or not _CLEAR_REFS.exists():
        return None
    peaks = []
    for count in (small, large, small, large):  # the first pair warms allocator and workspaces
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            return None
        base = current_rss_bytes()
        task.loss(model(data.inputs[:count]), data.targets[:count]).backward()
        peak = _peak_rss_bytes()
        if peak is None:
            return None
        peaks.append(peak - base)
    model.zero_grad(set_to_none=True)
    slope = (peaks[3] - peaks[2]) / (large - small)
    return max(1, math.ceil(slope)) if slope > 0 else None


def memory_model(
    model: nn.Module,
    task: Task,
    data: Split,
    split: ParamSplit,
    *,
    momentum: bool = False,
    runtime_bytes: int | None = None,
    probe: bool = True,
) -> MemoryModel:
    """The terms of M(b) for training `model` with `split` on `data`."""
    probed = probe_bytes_per_sample(model, task, data) if probe else None
    per_sample = (
        probed
        if probed is not None
        else ESTIMATE_FACTOR * activation_bytes_per_sample(model, task, data)
    )
    measured = MemoryModel(
        runtime_bytes=current_rss_bytes() if runtime_bytes is None else runtime_bytes,
        parameter_bytes=0,
        optimizer_bytes=0,
        activation_bytes_per_sample=per_sample,
        method="probe" if probed is not None else "estimate",
    )
    return for_split(measured, model, split, momentum=momentum)


def for_split(
    measured: MemoryModel,
    model: nn.Module,
    split: ParamSplit,
    *,
    momentum: bool = False,
    relayed_models: int = 0,
) -> MemoryModel:
    """`measured`'s runtime and activations with the parameter terms of `split`.

    The probe depends only on the architecture, so an agent measures once and re-plans each
    algorithm's split (and batch size) by arithmetic. A relay algorithm (FedeRiCo) holds
    `relayed_models` whole models at once, each as received bytes, decoded tensors, its
    weighted contribution and that contribution's encoded bytes: 4 model sizes apiece.
    """
    state = model.state_dict()
    shared = sum(state[n].numel() * state[n].element_size() for n in split.shared)
    personal = sum(state[n].numel() * state[n].element_size() for n in split.personal)
    return dataclasses.replace(
        measured,
        parameter_bytes=3 * (shared + personal)
        + 6 * shared
        + 5 * personal
        + 4 * relayed_models * (shared + personal),
        optimizer_bytes=(shared + personal) if momentum else 0,
    )


def plan_training(terms: MemoryModel, budget_bytes: int, batch_size: int) -> MemoryPlan:
    """The largest micro-batch b <= batch_size with M(b) within the budget (less a margin).

    Raises:
        MemoryBudgetError: even a micro-batch of one does not fit.
    """
    usable = budget_bytes - int(max(0, budget_bytes - terms.runtime_bytes) * SAFETY_MARGIN)
    fixed = terms.peak(0)
    per_sample = max(1, terms.activation_bytes_per_sample)
    largest = (usable - fixed) // per_sample
    if largest < 1:
        msg = (
            f"memory budget {budget_bytes / 2**20:.1f} MiB cannot fit local training: it needs "
            f"{terms.peak(1) / 2**20:.1f} MiB at a micro-batch of 1 (runtime "
            f"{terms.runtime_bytes / 2**20:.1f} MiB, parameters and gradients "
            f"{(terms.parameter_bytes + terms.optimizer_bytes) / 2**20:.1f} MiB) and a "
            f"{SAFETY_MARGIN:.0%} margin; raise --memory-budget or personalize fewer parameters"
        )
        raise MemoryBudgetError(msg)
    micro = int(min(batch_size, largest))
    return MemoryPlan(
        budget_bytes=budget_bytes,
        estimated_peak_bytes=terms.peak(micro),
        micro_batch_size=micro,
        accumulation_steps=math.ceil(batch_size / micro),
        method=terms.method,
    )
