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

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

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
    try:
        with torch.no_grad():
            model(inputs)
    finally:
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
