"""Gradient checkpointing over a model's top-level blocks, a lever of the memory plan.

A model whose forward is the composition of its top-level blocks (an `nn.Sequential`) can
keep only each block's input during the forward pass and recompute the block's internals
while backpropagating through it: activation memory falls from the sum over all blocks to
the block boundaries plus the largest block, for one more forward pass of compute. The last
block runs plainly (its activations are needed at once). The update is the plain one: random
draws replay (torch keeps the RNG state) and buffers that a recomputed forward pass would
update a second time (BatchNorm's running statistics and its step counter) are put back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Forward = Callable[[torch.Tensor], torch.Tensor]


def blocks(model: nn.Module) -> Sequence[nn.Module] | None:
    """The blocks checkpointing can recompute one at a time, or None (not a block sequence).

    Only an `nn.Sequential` says that its forward is its children in turn; any other module
    may combine its children in ways no wrapper can see. One child leaves nothing to split.
    """
    if not isinstance(model, nn.Sequential) or len(model) < 2:
        return None
    return tuple(model.children())


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run the body (a recomputation, a probe), then put `module`'s buffers back as they were."""
    kept = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def checkpointed(model: nn.Module) -> Forward:
    """`model`'s forward with every block but the last checkpointed.

    Raises:
        ValueError: `model` is not a sequence of blocks (see `blocks`).
    """
    parts = blocks(model)
    if parts is None:
        msg = f"{type(model).__name__} is not an nn.Sequential of blocks: nothing to checkpoint"
        raise ValueError(msg)
    *recomputed, last = parts

    def contexts(
        block: nn.Module,
    ) -> Callable[[], tuple[AbstractContextManager[None], AbstractContextManager[None]]]:
        return lambda: (nullcontext(), buffers_kept(block))

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        hidden = inputs
        for block in recomputed:
            hidden = checkpoint(block, hidden, use_reentrant=False, context_fn=contexts(block))
        output: torch.Tensor = last(hidden)
        return output

    return forward
