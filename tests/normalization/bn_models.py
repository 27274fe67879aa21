"""A small BatchNorm CNN on the bundled 8x8 digits, as a `--task module:attr` task for tests.

Two conv blocks with BatchNorm2d (running statistics and an int64 `num_batches_tracked` each)
and a linear head with BatchNorm1d: every kind of normalization state the device path handles.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.cnn_digits import images_and_labels
from pfl_tasks.supervised import supervised_task


class BnCnn(nn.Module):
    """conv-BN-ReLU twice, pooled, then a BN'd hidden layer and a linear head: 1x8x8 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 8, kernel_size=3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.hidden = nn.Sequential(nn.Linear(8 * 2 * 2, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores for a batch of images."""
        scores: torch.Tensor = self.head(self.hidden(self.features(images)))
        return scores


_images, _labels = images_and_labels()
task = supervised_task(
    "bn-digits",
    BnCnn,
    inputs=_images,
    targets=_labels,
    metric="accuracy",
    personal=("head.*",),
    input_names=("images",),
    output_names=("logits",),
)
