"""The digits-image task: the bundled 8x8 digits upsampled to 16x16 images for a 2-D CNN.

The digits task feeds flat pixels to MLPs; this one keeps them images, so convolutions and
normalization layers (BatchNorm by default, with its running statistics as buffers) get
exercised on real data with no download.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Final

import torch
from torch import nn
from torch.nn import functional

from pfl_tasks.base import DeviceData, PartitionSpec
from pfl_tasks.conv_models import ImageNorm, image_cnn
from pfl_tasks.digits import NUM_CLASSES, load_digits_pool
from pfl_tasks.models import Classification, build_seeded, check_int
from pfl_tasks.partition import fleet_from_pool

SOURCE_SIDE: Final = 8
IMAGE_SIDE: Final = 16
NORMS: Final = ("batch", "group", "none")


@functools.lru_cache(maxsize=1)
def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as (n, 1, 16, 16) float32 images in [0, 1] (bilinear), and labels."""
    pixels, labels = load_digits_pool()
    small = pixels.reshape(-1, 1, SOURCE_SIDE, SOURCE_SIDE)
    images = functional.interpolate(
        small, size=(IMAGE_SIDE, IMAGE_SIDE), mode="bilinear", align_corners=False
    )
    return images.clamp(0.0, 1.0).contiguous(), labels


class DigitsImageTask(Classification):
    """16x16 digit images for a small 2-D CNN (`image_cnn`: two conv blocks, 10k parameters).

    Args:
        channels: Channels of the first convolution (the second has twice as many).
        norm: "batch" (BatchNorm2d after each convolution), "group" (GroupNorm) or "none".
    """

    name: ClassVar[str] = "digits-image"
    personal_patterns: tuple[str, ...] = ("output.*",)
    input_names: tuple[str, ...] = ("image",)
    input_preprocessing: ClassVar[str] = (
        "pixels / 16, then the 8x8 image resized to 16x16 (bilinear, align_corners=False)"
    )
    output_names: tuple[str, ...] = ("logits",)

    def __init__(self, channels: int = 16, norm: ImageNorm = "batch") -> None:
        if norm not in NORMS:
            msg = f"unknown norm {norm!r}; valid choices: {', '.join(NORMS)}"
            raise ValueError(msg)
        self.channels = check_int("channels", channels)
        self.norm = norm

    def build_model(self, seed: int) -> nn.Module:
        """A fresh CNN whose initialization depends only on `seed`."""
        return build_seeded(
            seed, lambda: image_cnn(IMAGE_SIDE, NUM_CLASSES, self.channels, self.norm)
        )

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Partition the images across devices as the digits task does (same indices per seed).

        Raises:
            ValueError: If the partition cannot be made (see `partition_labels`).
        """
        images, labels = load_digit_images()
        return fleet_from_pool(images, labels.numpy(), labels, num_devices, partition, seed)
