"""FedSim's coordinator half: the same outer loop as FedAlt (spec §1.2)."""

from typing import Any

import numpy as np
import torch

from coordinator.strategies import build_strategy
from coordinator.strategies.fedsim import FedSimStrategy
from protocols.algorithms import FedAltConfig, FedSimConfig

from .random_updates import random_updates


def test_fedsim_aggregates_exactly_as_fedalt() -> None:
    rng = np.random.default_rng(5)
    shared = {"w": torch.zeros(3), "b": torch.ones(1)}
    updates = random_updates(rng, [2, 11, 5], {name: v.shape for name, v in shared.items()})
    choices: list[dict[str, Any]] = [
        {},
        {"aggregation_weights": "uniform", "server_optimizer": "fedadam"},
    ]
    for settings in choices:
        fedsim = build_strategy(FedSimConfig(**settings), 1.0)
        fedalt = build_strategy(FedAltConfig(**settings), 1.0)
        assert isinstance(fedsim, FedSimStrategy)
        a = fedsim.aggregate(1, shared, updates).shared
        b = fedalt.aggregate(1, shared, updates).shared
        for name in shared:
            assert torch.equal(a[name], b[name])
