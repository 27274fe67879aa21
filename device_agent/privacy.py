"""A device's side of differential privacy: clip its shared delta, add its noise share, say less.

Under DP a device reports only the clipped (and, with device placement, noised) shared delta:
its loss, sample count and algorithm scalars are not sent (they are functions of its data that
the accountant does not cover), and with adaptive clipping one noised, centred bit says whether
the delta was within the clip norm: +1/2 if it was, -1/2 if not. Centred, one device moves the
count by 1/2 when it joins or leaves, the sensitivity Andrew et al.'s (2 sigma_b) term assumes.
Personal parameters never leave the device, DP or not.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from device_agent.algorithms.base import LocalResult
from protocols.messages import DevicePrivacy
from protocols.privacy import add_gaussian_noise, clip_to_norm, update_norm, within_clip_bit


def privatize(
    result: LocalResult, privacy: DevicePrivacy, generator: torch.Generator
) -> tuple[LocalResult, float | None]:
    """(what the device may report, its noised within-clip bit when asked for one)."""
    norm = update_norm(result.shared_delta)
    clipped = clip_to_norm(result.shared_delta, privacy.clip_norm)
    # the discrete Gaussian is added on secure aggregation's integer grid (SecureClient.mask)
    std = 0.0 if privacy.discrete else privacy.noise_std
    noised = add_gaussian_noise(clipped, std, generator)
    within: float | None = None
    if privacy.report_clipped:
        noise = float(torch.randn((), generator=generator, dtype=torch.float64))
        within = within_clip_bit(norm, privacy.clip_norm) + privacy.indicator_std * noise
    private = replace(result, shared_delta=noised, num_samples=1, train_loss=0.0, scalars={})
    return private, within
