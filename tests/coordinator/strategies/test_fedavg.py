import numpy as np
import pytest
import torch

from coordinator.strategies import STRATEGIES, build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from protocols.algorithms import FedAvgConfig, FedProxConfig, LocalConfig

from .random_updates import random_updates


def _updates(rng: np.random.Generator, counts: list[int]) -> list[ReceivedUpdate]:
    return random_updates(rng, counts, {"hidden.weight": (2, 3), "output.bias": (2,)})


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedavg_aggregate_is_the_sample_weighted_mean(server_lr: float) -> None:
    # Prepare
    rng = np.random.default_rng(1)
    shared = {"hidden.weight": torch.zeros(2, 3), "output.bias": torch.ones(2)}
    counts = [3, 30, 7]
    updates = _updates(rng, counts)
    strategy = build_strategy(FedAvgConfig(server_lr=server_lr), participation=1.0)
    # Execute
    result = strategy.aggregate(1, shared, updates)
    # Assert: computed independently with numpy
    for name in shared:
        stacked = np.stack([u.shared_delta[name].numpy() for u in updates])
        weights = np.array(counts, dtype=np.float64).reshape(-1, *([1] * (stacked.ndim - 1)))
        mean = (stacked * weights).sum(axis=0) / sum(counts)
        expected = shared[name].numpy() + server_lr * mean
        np.testing.assert_allclose(result.shared[name].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fedprox_aggregates_as_fedavg_and_local_keeps_the_model() -> None:
    rng = np.random.default_rng(2)
    shared = {"hidden.weight": torch.zeros(2, 3), "output.bias": torch.zeros(2)}
    updates = _updates(rng, [4, 9])
    fedavg = build_strategy(FedAvgConfig(), 1.0).aggregate(1, shared, updates)
    fedprox = build_strategy(FedProxConfig(mu=1.0), 1.0).aggregate(1, shared, updates)
    local = build_strategy(LocalConfig(), 1.0).aggregate(1, shared, updates)
    for name in shared:
        torch.testing.assert_close(fedavg.shared[name], fedprox.shared[name])
        torch.testing.assert_close(local.shared[name], shared[name])


def test_plan_round_samples_the_participation_fraction_of_online_devices() -> None:
    fleet = FleetSnapshot(tuple(DeviceInfo(f"dev-{i:02d}", 10, online=i != 3) for i in range(20)))
    strategy = build_strategy(FedAvgConfig(), participation=0.25)
    plan = strategy.plan_round(1, fleet, np.random.default_rng(0))
    again = strategy.plan_round(1, fleet, np.random.default_rng(0))
    assert len(plan.devices) == 5  # ceil(0.25 * 19)
    assert "dev-03" not in plan.devices
    assert plan.devices == again.devices
    assert list(plan.devices) == sorted(plan.devices)


def test_every_registered_strategy_has_a_matching_config_name() -> None:
    for name, strategy in STRATEGIES.items():
        assert strategy.config_type.name == name
