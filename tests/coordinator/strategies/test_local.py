"""Tests for the local-only baseline's coordinator half: it samples like FedAvg, keeps no state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot
from coordinator.strategies.fedavg import FedAvgStrategy
from coordinator.strategies.local import LocalStrategy
from protocols.algorithms import FedAvgConfig, LocalConfig

from .random_updates import random_updates


def _fleet() -> FleetSnapshot:
    return FleetSnapshot(
        tuple(DeviceInfo(f"dev-{i}", 10 + i, online=i % 4 != 0) for i in range(12))
    )


def test_local_is_no_fedavg_but_plans_the_same_sample() -> None:
    # Prepare
    local = build_strategy(LocalConfig(), 0.5)
    fedavg = build_strategy(FedAvgConfig(), 0.5)
    # Execute
    planned = local.plan_round(3, _fleet(), np.random.default_rng(7))
    expected = fedavg.plan_round(3, _fleet(), np.random.default_rng(7))
    # Assert
    assert isinstance(local, LocalStrategy)
    assert not isinstance(local, FedAvgStrategy)
    assert planned == expected
    assert len(planned.devices) == 5  # half of the 9 online devices, rounded up
    assert set(planned.devices) <= set(_fleet().online())


def test_local_keeps_the_shared_part_and_no_state() -> None:
    # Prepare
    shared = {"w": torch.arange(4.0)}
    updates = random_updates(np.random.default_rng(1), [3, 8], {"w": (4,)})
    strategy = build_strategy(LocalConfig(), 1.0)
    # Execute
    result = strategy.aggregate(1, shared, updates)
    # Assert
    torch.testing.assert_close(result.shared["w"], torch.arange(4.0))
    assert result.shared is not shared
    assert strategy.state_dict() == {}
    strategy.load_state_dict({})


def test_local_refuses_another_algorithms_config() -> None:
    with pytest.raises(TypeError, match="local needs LocalConfig, got FedAvgConfig"):
        LocalStrategy(FedAvgConfig(), 1.0)
