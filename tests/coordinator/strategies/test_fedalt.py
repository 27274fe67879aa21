"""FedAlt's coordinator half: spec §1.2's sampling and aggregation, and the server optimizer."""

import json

import numpy as np
import pytest
import torch

from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from coordinator.strategies.fedalt import FedAltStrategy
from protocols.algorithms import AggregationWeights, FedAltConfig

from .random_updates import random_updates

COUNTS = [3, 30, 7]


def _updates(seed: int, counts: list[int]) -> list[ReceivedUpdate]:
    shapes = {"hidden.weight": (2, 3), "hidden.bias": (2,)}
    return random_updates(np.random.default_rng(seed), counts, shapes)


def _numpy_mean(updates: list[ReceivedUpdate], weights: list[float], name: str) -> np.ndarray:
    stacked = np.stack([u.shared_delta[name].numpy().astype(np.float64) for u in updates])
    w = np.array(weights).reshape(-1, *([1] * (stacked.ndim - 1)))
    mean: np.ndarray = (stacked * w).sum(axis=0) / sum(weights)
    return mean


@pytest.mark.parametrize(
    ("scheme", "weights"), [("samples", [3.0, 30.0, 7.0]), ("uniform", [1.0, 1.0, 1.0])]
)
def test_aggregate_is_the_chosen_weighted_mean_of_shared_deltas(
    scheme: AggregationWeights, weights: list[float]
) -> None:
    # Prepare: unequal sample counts, a server step size that is not 1
    shared = {"hidden.weight": torch.ones(2, 3), "hidden.bias": torch.zeros(2)}
    updates = _updates(1, COUNTS)
    config = FedAltConfig(aggregation_weights=scheme, server_lr=0.5)
    # Execute
    result = build_strategy(config, participation=1.0).aggregate(1, shared, updates)
    # Assert: computed independently in numpy
    for name in shared:
        expected = shared[name].numpy() + 0.5 * _numpy_mean(updates, weights, name)
        np.testing.assert_allclose(result.shared[name].numpy(), expected, rtol=1e-5, atol=1e-6)
    other = [1.0, 1.0, 1.0] if scheme == "samples" else [3.0, 30.0, 7.0]
    wrong = shared["hidden.bias"].numpy() + 0.5 * _numpy_mean(updates, other, "hidden.bias")
    assert not np.allclose(result.shared["hidden.bias"].numpy(), wrong, atol=1e-3)


def test_weights_renormalize_over_the_devices_that_reported() -> None:
    # Two of three sampled devices reported; their weights must sum to one on their own
    shared = {"hidden.weight": torch.zeros(2, 3), "hidden.bias": torch.zeros(2)}
    reported = _updates(2, COUNTS)[1:]
    result = build_strategy(FedAltConfig(), 1.0).aggregate(1, shared, reported)
    for name in shared:
        expected = _numpy_mean(reported, [30.0, 7.0], name)
        np.testing.assert_allclose(result.shared[name].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fedadam_strategy_steps_adam_and_resumes_from_its_state_dict() -> None:
    # Prepare
    config = FedAltConfig(server_optimizer="fedadam", server_lr=0.1)
    shared = {"hidden.weight": torch.zeros(2, 3), "hidden.bias": torch.zeros(2)}
    strategy = build_strategy(config, 1.0)
    after_one = strategy.aggregate(1, shared, _updates(3, COUNTS)).shared
    checkpoint = json.loads(json.dumps(strategy.state_dict()))
    resumed = build_strategy(config, 1.0)
    resumed.load_state_dict(checkpoint)
    # Execute
    continued = strategy.aggregate(2, after_one, _updates(4, COUNTS)).shared
    restored = resumed.aggregate(2, after_one, _updates(4, COUNTS)).shared
    # Assert: Adam's first step moves each coordinate by lr * sign(mean delta)
    mean = _numpy_mean(_updates(3, COUNTS), [3.0, 30.0, 7.0], "hidden.weight")
    np.testing.assert_allclose(after_one["hidden.weight"].numpy(), 0.1 * np.sign(mean), atol=1e-6)
    for name in shared:
        torch.testing.assert_close(restored[name], continued[name])


def test_plan_round_samples_without_replacement_among_online_devices() -> None:
    fleet = FleetSnapshot(
        tuple(DeviceInfo(f"dev-{i:02d}", 5, online=i % 4 != 0) for i in range(40))
    )
    strategy = build_strategy(FedAltConfig(), participation=0.2)
    plan = strategy.plan_round(3, fleet, np.random.default_rng(7))
    assert isinstance(strategy, FedAltStrategy)
    assert len(plan.devices) == 6  # ceil(0.2 * 30 online)
    assert len(set(plan.devices)) == 6
    assert all(int(d[-2:]) % 4 != 0 for d in plan.devices)


def test_no_shared_part_leaves_nothing_to_aggregate() -> None:
    # personal_preset "all": every tensor personal, the shared dict is empty
    result = build_strategy(FedAltConfig(personal_preset="all"), 1.0).aggregate(1, {}, [])
    assert result.shared == {}
