"""Plan local training to fit a memory budget: the largest micro-batch that fits, or a refusal.

The peak of one local update is modelled as (spec partial-personalization.md §4.1, §4.3)

    M(b) = R + 4|w| + B_opt + S + b * A_1

R is the process's resident memory when planning (Python, torch, the model, data). The spec's
3|u| + 2|v| (broadcast copy, working copy and gradients) is where the formula starts; what an
agent holds over R at its peak was measured in benchmarks/memory.py (one round held as an agent
holds it, every personalization mode): 3.5-3.9 model sizes whatever the split (the decoded
broadcast or the stored personal state, the gradients, the delta or snapshot, its encoding), so
the plan counts 4|w|. B_opt is the optimizer state (momentum), A_1 the memory one more sample
adds to a step and S what a step allocates whatever its size (STEP_OVERHEAD_SAMPLES x A_1).

A_1 comes from a probe where Linux lets us measure it: two real forward/backward steps in a row at
each of two micro-batch sizes, each pair after trimming the heap and resetting the kernel's peak
counter, and the slope between them plus a measured margin (this catches backward temporaries
and kernel workspaces that no formula lists; docs/memory.md has the measurements). Elsewhere it is
estimated as 3x the bytes autograd saves for backward, counted exactly with saved-tensor hooks.
Both hold for any layer (convolution, recurrence, normalization) without a table of layers.

Two levers bring a batch within the budget: micro-batches with gradient accumulation (the same
update to float tolerance; with BatchNorm, statistics are per micro-batch) and gradient
checkpointing over the model's top-level blocks (device_agent/checkpointing.py), whose A_1 is
probed the same way with the blocks recomputed. Recomputing costs about one more forward pass
per step while a micro-batch costs one more call, so the plan checkpoints only where that at
least halves the micro-batches per step (or where nothing fits otherwise), and refuses when
neither fits one sample.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import psutil
import torch
from torch import nn

from device_agent.checkpointing import Forward, blocks, buffers_kept, checkpointed
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
    checkpointed_bytes_per_sample: int | None = None
    """A_1 with the top-level blocks checkpointed; None where the model has no blocks."""
    step_overhead_bytes: int = 0
    """What a training step allocates whatever its micro-batch (STEP_OVERHEAD_SAMPLES)."""

    def peak(self, micro_batch: int, *, checkpointing: bool = False) -> int:
        """M(b) for a micro-batch of `micro_batch` samples, plainly or checkpointed."""
        return (
            self.runtime_bytes
            + self.parameter_bytes
            + self.optimizer_bytes
            + self.step_overhead_bytes
            + micro_batch * self.per_sample(checkpointing=checkpointing)
        )

    def per_sample(self, *, checkpointing: bool) -> int:
        """A_1, checkpointed or not (checkpointing without blocks: plain).

        At least one byte, so the plan never divides by zero.
        """
        checkpointed = self.checkpointed_bytes_per_sample
        per_sample = checkpointed if checkpointing and checkpointed is not None else None
        return max(1, self.activation_bytes_per_sample if per_sample is None else per_sample)


def _saved_bytes(
    run: Forward, inputs: torch.Tensor, parameter_pointers: set[int]
) -> tuple[torch.Tensor, int]:
    """`run(inputs)` and the bytes autograd saves for its backward, parameters not counted."""
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
        outputs = run(inputs)
    return outputs, saved


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def activation_bytes_per_sample(
    model: nn.Module, task: Task, data: Split, probe_batch: int = 4
) -> int:
    """Bytes autograd keeps for backward per sample, counted on a probe forward pass.

    Parameters saved for backward are excluded (they are counted as parameters); a batch of
    `probe_batch` rather than 1 averages out per-batch constants.
    """
    count = max(1, min(probe_batch, len(data)))
    pointers = {p.data_ptr() for p in model.parameters()}
    outputs, saved = _saved_bytes(model, data.inputs[:count], pointers)
    loss = task.loss(outputs, data.targets[:count])
    saved += _nbytes(outputs) + _nbytes(loss)
    del loss, outputs
    return math.ceil(float(saved) / count)


def checkpointed_bytes_per_sample(
    model: nn.Module, task: Task, data: Split, probe_batch: int = 4
) -> int | None:
    """What `activation_bytes_per_sample` counts with the top-level blocks checkpointed.

    Each recomputed block keeps only its input until backward reaches it, then holds its own
    saved tensors alone: the boundaries, plus the largest recomputed block, plus the last
    block (run plainly). None where the model has no blocks to checkpoint.
    """
    parts = blocks(model)
    if parts is None:
        return None
    count = max(1, min(probe_batch, len(data)))
    pointers = {p.data_ptr() for p in model.parameters()}
    hidden = data.inputs[:count]
    boundaries, largest = 0, 0
    for block in parts[:-1]:
        boundaries += _nbytes(hidden)
        hidden, saved = _saved_bytes(block, hidden, pointers)
        largest = max(largest, saved)
    outputs, last = _saved_bytes(parts[-1], hidden, pointers)
    loss = task.loss(outputs, data.targets[:count])
    total = boundaries + largest + last + _nbytes(outputs) + _nbytes(loss)
    del loss, outputs, hidden
    return math.ceil(float(total) / count)


_CLEAR_REFS: Final = Path("/proc/self/clear_refs")
_STATUS: Final = Path("/proc/self/status")
STEPS_PROBED: Final = 2
"""Steps in a row per probed size: a second step finds the heap fragmented by the first and
peaks higher (by 10-25% on the 1-D CNN of benchmarks/memory_conv.py), as every later one does."""
PROBE_MARGIN: Final = 0.25
"""Added to a probed A_1 (plain training). Measured in one process after its probe (the 1-D CNN
of benchmarks/memory_conv.py, slope 711 KiB a sample): two steps at 512 samples, a size the probe
had not run, peaked 77 MiB (22%) above slope x size, as larger tensors find no free chunk in the
heap. What a step adds whatever its size is STEP_OVERHEAD_SAMPLES's; the 10% budget margin of
the plan (SAFETY_MARGIN) covers what varies beyond that between processes."""
CHECKPOINTED_PROBE_MARGIN: Final = 1.0
"""Added to a probed A_1 with checkpointing. Its probe reads short: on the same CNN it read
405-622 KiB a sample in different processes, against 778-793 KiB a sample that checkpointed
training steps of 234 samples then reached (recomputation allocates each block's internals
again during backward, next to the gradients of the block's output), so the plan doubles it."""
SAVED_FLOOR: Final = 2
"""A probed A_1 is at least this many times the bytes autograd saves (see `_with_margin`)."""
STEP_OVERHEAD_SAMPLES: Final = 64
"""A step's overhead, in samples of the plain A_1: the slope cancels whatever a step allocates
whatever its size, which a step at a shape the probe did not run does (workspaces, chunks
that fit no free space): 16-21 MiB beyond slope x size in the process that probed the 1-D CNN,
53 MiB in the 6-step training run of 153-sample micro-batches of benchmarks/memory_conv.py
(64 samples of that CNN's A_1 are 56 MiB)."""
ROUND_COPIES: Final = 4
"""Model sizes a round holds over R (module docstring; benchmarks/memory.py, modes table)."""
ESTIMATE_FACTOR: Final = 3
"""Saved activations plus their gradients plus the pre-activation temporaries, per sample."""
CHECKPOINTED_ESTIMATE_MARGIN: Final = 0.5
"""Added to a counted (not probed) A_1 with checkpointing, which cannot see how the allocator
hands back what recomputation frees. On the 1-D CNN of tests/device_agent/test_activation_memory.py
the bare count was 11% under a checkpointed step's peak on torch 2.13 and 8-48% under it on
torch 2.1 in three fresh processes (glibc's heap keeps freed blocks there:
benchmarks/heap_threshold.py); the plain count was 19-56% over its peak on both."""


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim; elsewhere nothing).

    Freed tensors of a few MiB stay resident in glibc's heap (its mmap threshold rises as they
    are freed), so a later step reuses them without growing the resident set: a probe would
    read too little growth, and the runtime too much. Trimming first measures both as they are.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return


def _peak_rss_bytes() -> int | None:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def probe_bytes_per_sample(
    model: nn.Module,
    task: Task,
    data: Split,
    sizes: tuple[int, int] = (16, 256),
    forward: Forward | None = None,
) -> int | None:
    """Measured memory per sample of a training step, or None where it cannot be measured.

    `forward` runs the model (default: `model` itself; e.g. its checkpointed forward).
    Gradients are zeroed afterwards, parameters are not stepped.
    """
    run = model if forward is None else forward
    small, large = min(sizes[0], len(data)), min(sizes[1], len(data))
    if large <= small or not _CLEAR_REFS.exists():
        return None

    def steps(count: int, repeats: int) -> None:
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            task.loss(run(data.inputs[:count]), data.targets[:count]).backward()

    steps(small, 1)  # warms allocator, kernels and workspaces
    steps(large, 1)
    peaks = []
    for count in (small, large):
        release_free_heap()
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            return None
        base = current_rss_bytes()
        steps(count, STEPS_PROBED)
        peak = _peak_rss_bytes()
        if peak is None:
            return None
        peaks.append(peak - base)
    model.zero_grad(set_to_none=True)
    slope = (peaks[1] - peaks[0]) / (large - small)
    return max(1, math.ceil(slope)) if slope > 0 else None


def _with_margin(probed: int | None, saved: int, margin: float) -> int | None:
    """A probed A_1, at least twice the bytes autograd saves for backward, plus `margin`.

    The slope reads short where a step reuses heap chunks the step before freed: the
    5M-parameter MLP of benchmarks/memory.py read 18-83 KiB a sample in different processes,
    while its steps grew by 37-56 KiB a sample between 512 and 2048 samples; backward holds
    the saved tensors (18 KiB a sample there) and gradients as large, so the floor is 2x saved.
    """
    floor = SAVED_FLOOR * saved
    return None if probed is None else math.ceil(max(probed, floor) * (1 + margin))


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
    """The terms of M(b) for training `model` with `split` on `data`.

    Buffers (BatchNorm's running statistics) are as they were afterwards: probing is not
    training.
    """
    with buffers_kept(model):
        saved = activation_bytes_per_sample(model, task, data)
        probed = _with_margin(
            probe_bytes_per_sample(model, task, data) if probe else None, saved, PROBE_MARGIN
        )
        per_sample = probed if probed is not None else ESTIMATE_FACTOR * saved
        checkpointed_per_sample = None
        counted = checkpointed_bytes_per_sample(model, task, data)
        if counted is not None:
            probed_checkpointed = _with_margin(
                probe_bytes_per_sample(model, task, data, forward=checkpointed(model))
                if probed is not None
                else None,
                counted,
                CHECKPOINTED_PROBE_MARGIN,
            )
            checkpointed_per_sample = (
                probed_checkpointed
                if probed_checkpointed is not None
                else math.ceil(ESTIMATE_FACTOR * counted * (1 + CHECKPOINTED_ESTIMATE_MARGIN))
            )
    release_free_heap()
    measured = MemoryModel(
        runtime_bytes=current_rss_bytes() if runtime_bytes is None else runtime_bytes,
        parameter_bytes=0,
        optimizer_bytes=0,
        activation_bytes_per_sample=per_sample,
        method="probe" if probed is not None else "estimate",
        checkpointed_bytes_per_sample=checkpointed_per_sample,
        step_overhead_bytes=STEP_OVERHEAD_SAMPLES * per_sample,
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
    algorithm's split (and batch size) by arithmetic. The round itself holds 4 model sizes
    over R whatever the split (module docstring). A relay algorithm (FedeRiCo) holds
    `relayed_models` whole models at once, each as received bytes, decoded tensors, its
    weighted contribution and that contribution's encoded bytes: 4 model sizes apiece.
    """
    state = model.state_dict()
    size = sum(state[n].numel() * state[n].element_size() for n in (*split.shared, *split.personal))
    return dataclasses.replace(
        measured,
        parameter_bytes=ROUND_COPIES * size + 4 * relayed_models * size,
        optimizer_bytes=size if momentum else 0,
    )


CHECKPOINT_GAIN: Final = 2
"""How many times fewer micro-batches per step checkpointing must need to be planned."""


def _largest_micro_batch(terms: MemoryModel, usable: int, *, checkpointing: bool) -> int:
    """The most samples M(b) fits within `usable` bytes (0: not even one)."""
    per_sample = terms.per_sample(checkpointing=checkpointing)
    return max(0, (usable - terms.peak(0)) // per_sample)


def plan_training(terms: MemoryModel, budget_bytes: int, batch_size: int) -> MemoryPlan:
    """The largest micro-batch b <= batch_size with M(b) within the budget (less a margin).

    Gradient checkpointing is planned where it needs at most half the micro-batches per step
    that plain training needs, or where plain training cannot fit one sample.

    Raises:
        MemoryBudgetError: even a micro-batch of one does not fit, checkpointed or not.
    """
    usable = budget_bytes - int(max(0, budget_bytes - terms.runtime_bytes) * SAFETY_MARGIN)
    plain = min(batch_size, _largest_micro_batch(terms, usable, checkpointing=False))
    can_checkpoint = terms.checkpointed_bytes_per_sample is not None
    recomputed = (
        min(batch_size, _largest_micro_batch(terms, usable, checkpointing=True))
        if can_checkpoint
        else 0
    )
    if plain < 1 and recomputed < 1:
        raise MemoryBudgetError(_refusal(terms, budget_bytes, can_checkpoint=can_checkpoint))
    checkpointing = recomputed >= 1 and (
        plain < 1
        or CHECKPOINT_GAIN * math.ceil(batch_size / recomputed) <= math.ceil(batch_size / plain)
    )
    micro = recomputed if checkpointing else plain
    return MemoryPlan(
        budget_bytes=budget_bytes,
        estimated_peak_bytes=terms.peak(micro, checkpointing=checkpointing),
        micro_batch_size=micro,
        accumulation_steps=math.ceil(batch_size / micro),
        method=terms.method,
        checkpointing=checkpointing,
    )


def _refusal(terms: MemoryModel, budget_bytes: int, *, can_checkpoint: bool) -> str:
    """Why not even one sample fits: the budget against each term of M(1)."""
    mib = 2**20
    checkpointed = (
        f" ({terms.peak(1, checkpointing=True) / mib:.1f} MiB with gradient checkpointing)"
        if can_checkpoint
        else " (the model is no nn.Sequential of blocks: no gradient checkpointing)"
    )
    return (
        f"memory budget {budget_bytes / mib:.1f} MiB cannot fit local training: it needs "
        f"{terms.peak(1) / mib:.1f} MiB at a micro-batch of 1{checkpointed} (runtime "
        f"{terms.runtime_bytes / mib:.1f} MiB, parameters and gradients "
        f"{(terms.parameter_bytes + terms.optimizer_bytes) / mib:.1f} MiB, a step's overhead "
        f"{terms.step_overhead_bytes / mib:.1f} MiB, activations "
        f"{terms.per_sample(checkpointing=False) / mib:.2f} MiB a sample) and a "
        f"{SAFETY_MARGIN:.0%} margin; raise --memory-budget or personalize fewer parameters"
    )
