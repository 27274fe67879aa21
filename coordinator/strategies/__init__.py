"""One strategy module per algorithm, and the registry that selects them by name."""

from __future__ import annotations

from coordinator.strategies.base import Strategy
from coordinator.strategies.ditto import DittoStrategy
from coordinator.strategies.fedalt import FedAltStrategy
from coordinator.strategies.fedavg import FedAvgStrategy
from coordinator.strategies.fedavg_ft import FedAvgFtStrategy
from coordinator.strategies.federico import FedericoStrategy
from coordinator.strategies.fedprox import FedProxStrategy
from coordinator.strategies.fedsim import FedSimStrategy
from coordinator.strategies.local import LocalStrategy
from coordinator.strategies.pfedbred import PFedBreDStrategy, PFedMeStrategy
from coordinator.strategies.selffl import SelfFlAugStrategy, SelfFlStrategy
from protocols.algorithms import AlgorithmConfig

STRATEGIES: dict[str, type[Strategy]] = {
    strategy.name: strategy
    for strategy in (
        LocalStrategy,
        FedAvgStrategy,
        FedAvgFtStrategy,
        FedProxStrategy,
        FedAltStrategy,
        FedSimStrategy,
        PFedMeStrategy,
        PFedBreDStrategy,
        DittoStrategy,
        SelfFlStrategy,
        SelfFlAugStrategy,
        FedericoStrategy,
    )
}


def build_strategy(config: AlgorithmConfig, participation: float) -> Strategy:
    """The coordinator half of the algorithm `config` belongs to.

    Raises:
        ValueError: no strategy is registered under the config's name.
    """
    strategy_type = STRATEGIES.get(config.name)
    if strategy_type is None:
        msg = f"unknown algorithm {config.name!r}; choose one of: {', '.join(sorted(STRATEGIES))}"
        raise ValueError(msg)
    return strategy_type(config, participation)
