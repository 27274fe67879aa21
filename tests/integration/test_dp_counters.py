"""A model's integer tensors (BatchNorm's step counter) never leave the device, DP or not.

Clipping and noise apply to floating tensors only; `num_batches_tracked` would travel exact and
give away how many local steps, hence how many samples, the device trained on, and a float mean
of counts is no count. Running statistics leave only when shared (--norm-stats shared).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

import pytest
from torch import nn

from pfl_tasks.digits import NUM_CLASSES, NUM_PIXELS, DigitsTask
from pfl_tasks.models import build_seeded
from tests.normalization.bn_fleet import DEVICES, run_fleet

COUNTER = "norm.num_batches_tracked"
MEAN = "norm.running_mean"


class NormedDigitsTask(DigitsTask):
    """Digits with a BatchNorm layer after the hidden one."""

    name: ClassVar[str] = "normed-digits"

    def build_model(self, seed: int) -> nn.Module:
        """An MLP whose hidden layer is batch-normalized."""
        return build_seeded(
            seed,
            lambda: nn.Sequential(
                OrderedDict(
                    hidden=nn.Linear(NUM_PIXELS, 32),
                    norm=nn.BatchNorm1d(32),
                    act=nn.ReLU(),
                    output=nn.Linear(32, NUM_CLASSES),
                )
            ),
        )


@pytest.mark.parametrize(
    "run",
    [
        {},
        {"norm_stats": "shared"},
        {"dp_noise": 1.0},
        {"dp_noise": 1.0, "norm_stats": "shared"},
        {"dp_noise": 1.0, "dp_placement": "device", "secagg": True},
        {"dp_noise": 1.0, "dp_placement": "device", "secagg": True, "norm_stats": "shared"},
        {"compress": "int8"},
        {"compress": "int8", "norm_stats": "shared"},
    ],
    ids=[
        "plain",
        "shared",
        "dp",
        "dp-shared",
        "dp-device-secagg",
        "dp-device-secagg-shared",
        "int8-uplink",
        "int8-uplink-shared",
    ],
)
def test_the_step_counter_is_never_sent_nor_averaged(run: dict[str, Any]) -> None:
    fleet = run_fleet(NormedDigitsTask(), batch_size=4096, **run)  # one batch per epoch
    updates = [update for by_device in fleet.updates for update in by_device.values()]
    assert len(updates) == 2 * len(DEVICES)
    assert all(COUNTER not in update for update in updates)
    assert COUNTER not in fleet.shared  # no mean of counts exists anywhere
    averaged = run.get("norm_stats") == "shared"
    assert (MEAN in fleet.shared) == averaged
    if averaged:  # moved from its initial zeros by the devices' statistics
        assert float(fleet.shared[MEAN].abs().sum()) > 0
    if "secagg" not in run:  # a masked update is one flat vector, not named tensors
        assert {MEAN in update for update in updates} == {averaged}
