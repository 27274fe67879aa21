"""How many torch intra-op threads a training step can use well.

Torch splits an operation over its threads, and every split pays to wake them; between
operations OpenMP's threads spin. For the small models of a typical fleet that costs more than it
gives: an MLP step of a few thousand multiply-adds runs 1.2-1.8x slower on two threads than on
one, and keeps both cores busy. Splitting pays from about 8 million multiply-adds a step (a
153,000-parameter MLP at batch 64, measured on this project's 2-core machines), so a process
training such models gets one thread per that much work, up to its cores. The choice depends
only on the model and the batch size, never on timings, so it is the same on every run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

MACS_PER_THREAD = 8_000_000
"""Multiply-adds of one training step's forward pass that make another thread worth it."""


def forward_macs(model: nn.Module, inputs: torch.Tensor) -> int:
    """Multiply-adds of one forward pass of `inputs`: linear and convolution layers counted.

    Other parameters (norms, embeddings, custom layers) count one multiply-add each per sample,
    an underestimate only where they are cheap anyway.
    """
    counted: set[int] = set()
    total = 0

    def count(module: nn.Module, args: object, output: object) -> None:
        nonlocal total
        if not isinstance(output, torch.Tensor):
            return
        if isinstance(module, nn.Linear):
            total += output.numel() * module.in_features
        elif isinstance(module, nn.modules.conv._ConvNd):
            total += output.numel() * module.weight[0].numel()

    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)]
    for layer in layers:
        counted.update(id(p) for p in layer.parameters(recurse=False))
    handles = [layer.register_forward_hook(count) for layer in layers]
    training = model.training
    model.eval()  # one sample: BatchNorm cannot train on it, and its statistics stay as they are
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    others = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    return total + others * len(inputs)


def step_macs(model: nn.Module, inputs: Iterable[torch.Tensor], batch_size: int) -> int:
    """Multiply-adds of one training step's forward pass at `batch_size` (0: no sample).

    Counted on one sample of the first non-empty `inputs`: the count grows with the batch.
    """
    sample = next((batch[:1] for batch in inputs if len(batch)), None)
    return 0 if sample is None else forward_macs(model, sample) * batch_size


def largest_step_macs(model: nn.Module, inputs: Sequence[torch.Tensor], batch_size: int) -> int:
    """Multiply-adds of the largest training step at `batch_size` of devices with `inputs`.

    A batch holds at most a device's whole data, so a batch size above the largest device's
    sample count counts as that count.
    """
    largest = max((len(batch) for batch in inputs), default=0)
    return step_macs(model, inputs, min(batch_size, largest))


def available_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def useful_threads(step_macs: int, cores: int) -> int:
    """Threads for steps of `step_macs` multiply-adds: one per MACS_PER_THREAD, 1 to `cores`."""
    return max(1, min(cores, step_macs // MACS_PER_THREAD))


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Torch's intra-op threads set to `count` while inside, then as they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class StepThreads:
    """Threads for one device's training steps at each batch size, at most `cores`.

    A device learns its batch size from each announcement; its forward pass is counted once,
    on one sample through a fresh copy of the model (a pass through the workspace could move
    a batch norm's running statistics).
    """

    def __init__(self, fresh_model: nn.Module, inputs: Iterable[torch.Tensor], cores: int) -> None:
        self.per_sample = step_macs(fresh_model, inputs, 1)
        self.cores = max(1, cores)

    def __call__(self, batch_size: int) -> int:
        """Threads for a step of `batch_size` samples."""
        return useful_threads(self.per_sample * batch_size, self.cores)


def threads_for(choice: StepThreads | None, batch_size: int) -> AbstractContextManager[None]:
    """`choice`'s threads for steps of `batch_size` while inside; without a choice, as they are."""
    return nullcontext() if choice is None else torch_threads(choice(batch_size))
