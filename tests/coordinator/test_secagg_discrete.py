"""The distributed discrete Gaussian through the secure-aggregation protocol (no training).

SecureClients with known deltas add their integer noise in the ring and the coordinator unmasks
the sum: its error against the plain sum is the noise of the devices in it, nothing else.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols import secure_aggregation as sa
from protocols.messages import DevicePrivacy
from tests.coordinator.test_secagg_protocol import _total, build

CLIP = 10.0  # above every test delta's norm (about 3.5): nothing is clipped


def _error(devices: int, share: float, rounds: int, drop: int = 0) -> tuple[np.ndarray, float]:
    """Unmasked sum minus the survivors' plain sum over `rounds` rounds; the last grid step."""
    privacy = DevicePrivacy(clip_norm=CLIP, noise_std=share, discrete=True)
    errors, step = [], 0.0
    for seed in range(rounds):  # a fleet a round: no late answer of one round in the next
        harness = build(devices, seed=seed, clip=CLIP)
        for device in list(harness.devices.values())[:drop]:
            device.masked_tweak = lambda vector: None  # deals its shares, then drops out
        result = harness.run(privacy=privacy)
        assert len(result.survivors) == devices - drop
        assert harness.offences == []
        errors.append(_total(result) - harness.plain_sum(result.survivors))
        assert harness.secure is not None
        step = 1 / sa.delta_scale(harness.secure)
    return np.concatenate(errors), step


def test_without_noise_the_sum_is_the_plain_sum_within_one_grid_step_per_device() -> None:
    error, step = _error(6, 0.0, 1)
    # randomized rounding moves each device by under one step; float32 tensors add their own
    assert np.abs(error).max() <= 6 * step + 1e-5


@pytest.mark.parametrize("drop", [0, 2])
def test_the_unmasked_sum_carries_the_noise_of_its_survivors(drop: int) -> None:
    share = 0.05
    error, step = _error(8, share, 6, drop)
    survivors = 8 - drop
    assert step < 1e-6  # the noise is N_Z on a fine grid: millions of steps per unit
    expected = share * math.sqrt(survivors)
    assert error.std() == pytest.approx(expected, rel=0.12)
    assert abs(error.mean()) < 5 * expected / math.sqrt(error.size)
