"""Edge-shaped models for the export tests and the latency benchmark, on the bundled digits.

A CNN (examples.cnn_digits), the same with BatchNorm (tests.normalization.bn_models) and a GRU
reading each 8x8 image as 8 time steps of 8 features: convolution, normalization, recurrence.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.cnn_digits import images_and_labels
from pfl_tasks.base import Task
from pfl_tasks.supervised import supervised_task

PREPROCESSING = "pixels / 16: the 0-16 grey levels scaled to [0, 1]"


class RowGru(nn.Module):
    """A one-layer GRU over the image's rows, classifying from its last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(input_size=8, hidden_size=32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores for a batch of (n, 1, 8, 8) images."""
        _, hidden = self.gru(images.flatten(1, 2))
        scores: torch.Tensor = self.head(hidden[-1])
        return scores


def gru_task() -> Task:
    """The digits as row sequences for RowGru."""
    images, labels = images_and_labels()
    task = supervised_task(
        "gru-digits",
        RowGru,
        inputs=images,
        targets=labels,
        metric="accuracy",
        input_names=("images",),
        output_names=("logits",),
    )
    task.input_preprocessing = PREPROCESSING  # type: ignore[attr-defined]
    return task


def with_preprocessing(task: Task) -> Task:
    """`task`, declaring the digits' scaling for its exported files' metadata."""
    task.input_preprocessing = PREPROCESSING  # type: ignore[attr-defined]
    return task
