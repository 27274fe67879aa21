"""Your own model and data as a pfl-edge task: a small CNN on 8x8 images (docs/own-task.md).

The images are scikit-learn's bundled handwritten digits, treated as if they were your own
data set: pooled arrays for simulation, one `--data` directory per real device. The CNN's
classifier head is personal by default; its convolutions are shared across the fleet.

    pfl-coord simulate --task examples.cnn_digits:task --algorithm fedalt --out runs/cnn
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from pfl_tasks.supervised import supervised_task


class SmallCnn(nn.Module):
    """Two 3x3 convolutions and a linear head: 1x8x8 images in, 10 class scores out."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Linear(16 * 2 * 2, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores for a batch of images."""
        scores: torch.Tensor = self.head(self.features(images))
        return scores


def images_and_labels() -> tuple[np.ndarray, np.ndarray]:
    """The digits as float32 images of shape (n, 1, 8, 8) in [0, 1], and int64 labels."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    return images, digits.target.astype(np.int64)


images, labels = images_and_labels()
task = supervised_task(
    "cnn-digits",
    SmallCnn,
    inputs=images,
    targets=labels,
    metric="accuracy",
    personal=("head.*",),
    input_names=("images",),
    output_names=("logits",),
)
