"""Edge-sized models of the signal and image tasks: 1-D CNNs, a GRU, and a 2-D CNN.

Every model's first parametrized layer is named `input` and its last `output`, so the task's
default personal pattern ("output.*") and the `input`/`output` presets name the same roles as
on the built-in MLPs. Layers that hold no parameters are plain modules between them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Final, Literal

import torch
from torch import nn

SignalNorm = Literal["group", "batch", "none"]
ImageNorm = Literal["batch", "group", "none"]
NORM_GROUPS: Final = 4
"""GroupNorm's groups (or the largest divisor of the channel count below it)."""


def _norm(kind: str, channels: int, dims: int) -> nn.Module:
    """The normalization after a convolution: GroupNorm, BatchNorm (1-D or 2-D) or none."""
    if kind == "group":
        return nn.GroupNorm(math.gcd(NORM_GROUPS, channels), channels)
    if kind == "batch" and dims in (1, 2):
        return nn.BatchNorm1d(channels) if dims == 1 else nn.BatchNorm2d(channels)
    if kind == "none":
        return nn.Identity()
    msg = f"unknown norm {kind!r} for a {dims}-D CNN"
    raise ValueError(msg)


def signal_cnn(
    length: int, classes: int, channels: int = 48, norm: SignalNorm = "group"
) -> nn.Module:
    """Three conv blocks (conv, norm, ReLU, max-pool by 2) over a 1-channel signal, a linear head.

    Kernel 5 then 3 and 3, `channels` wide throughout; the head reads the flattened feature map,
    so it sees where along the signal a feature occurs (MNIST-1D's digits differ by shape and
    position). With 48 channels on 40 samples: 17k parameters. Input (n, length); output
    (n, classes).
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict(reshape=nn.Unflatten(1, (1, length)))
    width, size = 1, length
    for block, (name, kernel) in enumerate((("input", 5), ("conv2", 3), ("conv3", 3)), start=1):
        layers[name] = nn.Conv1d(width, channels, kernel, padding=kernel // 2)
        layers[f"norm{block}"] = _norm(norm, channels, 1)
        layers[f"act{block}"] = nn.ReLU()
        layers[f"pool{block}"] = nn.MaxPool1d(2)
        width, size = channels, size // 2
    layers["flatten"] = nn.Flatten()
    layers["output"] = nn.Linear(channels * size, classes)
    return nn.Sequential(layers)


def paper_cnn(length: int, classes: int, channels: int = 25) -> nn.Module:
    """The MNIST-1D paper's CNN (Greydanus 2020, `ConvBase`): three strided convolutions, a head.

    Conv1d(1, 25, 5, stride 2, padding 1), then two Conv1d(25, 25, 3, stride 2, padding 1),
    ReLU after each, no normalization or pooling; the head reads the flattened map (25 x 5 on
    40 samples: 5,210 parameters). Kept beside `signal_cnn` so the published 94% is measured on
    the published architecture. Input (n, length); output (n, classes).
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict(reshape=nn.Unflatten(1, (1, length)))
    width, size = 1, length
    for block, (name, kernel) in enumerate((("input", 5), ("conv2", 3), ("conv3", 3)), start=1):
        layers[name] = nn.Conv1d(width, channels, kernel, stride=2, padding=1)
        layers[f"act{block}"] = nn.ReLU()
        width, size = channels, (size + 2 - kernel) // 2 + 1
    layers["flatten"] = nn.Flatten()
    layers["output"] = nn.Linear(channels * size, classes)
    return nn.Sequential(layers)


class SignalGru(nn.Module):
    """A bidirectional GRU over the signal's samples, every step's state read by a linear head.

    As the published MNIST-1D GRU: one feature per time step, the head over all steps' hidden
    states (not just the last), which lets a small recurrent state classify well.
    Input (n, length); output (n, classes).
    """

    def __init__(self, length: int, classes: int, hidden: int = 6) -> None:
        super().__init__()
        self.input = nn.GRU(1, hidden, batch_first=True, bidirectional=True)
        self.output = nn.Linear(2 * hidden * length, classes)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        """Run the GRU both ways over the samples, classify from all hidden states."""
        states, _ = self.input(signals.unsqueeze(-1))
        logits: torch.Tensor = self.output(states.flatten(1))
        return logits


def image_cnn(side: int, classes: int, channels: int = 16, norm: ImageNorm = "batch") -> nn.Module:
    """Two conv blocks (3x3 conv, norm, ReLU, 2x2 max-pool) over 1-channel images, a linear head.

    `channels` then twice as many; with BatchNorm and 16x16 inputs: 10k parameters and two
    BatchNorm layers whose running statistics are buffers (`norm1.running_mean`, ...).
    Input (n, 1, side, side); output (n, classes).
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    width, size = 1, side
    for block, name in enumerate(("input", "conv2"), start=1):
        out = channels * block
        layers[name] = nn.Conv2d(width, out, 3, padding=1)
        layers[f"norm{block}"] = _norm(norm, out, 2)
        layers[f"act{block}"] = nn.ReLU()
        layers[f"pool{block}"] = nn.MaxPool2d(2)
        width, size = out, size // 2
    layers["flatten"] = nn.Flatten()
    layers["output"] = nn.Linear(width * size * size, classes)
    return nn.Sequential(layers)
