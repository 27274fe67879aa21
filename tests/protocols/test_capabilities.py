"""Every algorithm declares its capabilities itself: a new one cannot inherit them by accident."""

from __future__ import annotations

from typing import ClassVar

import pytest

from protocols.algorithms import (
    ALGORITHM_CONFIGS,
    AlgorithmConfig,
    FedAvgConfig,
    parse_algorithm_config,
)
from protocols.capabilities import Capabilities


def _subclasses(base: type[AlgorithmConfig]) -> list[type[AlgorithmConfig]]:
    found = []
    for sub in base.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _declares(config: type[AlgorithmConfig]) -> bool:
    return isinstance(vars(config).get("capabilities"), Capabilities)


def test_the_base_config_declares_nothing() -> None:
    assert not hasattr(AlgorithmConfig, "capabilities")


@pytest.mark.parametrize("config", _subclasses(AlgorithmConfig), ids=lambda c: c.__name__)
def test_every_named_algorithm_is_registered_and_declares_its_capabilities(
    config: type[AlgorithmConfig],
) -> None:
    if "name" not in vars(config):
        return  # a family's shared settings (PartialConfig, ProximalPriorConfig), never run
    assert ALGORITHM_CONFIGS[config.name] is config
    assert _declares(config), (
        f"{config.__name__} must declare its own capabilities (protocols/capabilities.py)"
    )


def test_a_new_algorithm_that_forgets_them_fails_the_walk() -> None:
    class Forgetful(FedAvgConfig):
        name: ClassVar[str] = "forgetful"

    assert Forgetful.capabilities == FedAvgConfig.capabilities  # inherited, so not declared
    assert Forgetful in _subclasses(AlgorithmConfig)
    assert not _declares(Forgetful)


@pytest.mark.parametrize("name", sorted(ALGORITHM_CONFIGS))
def test_every_algorithm_declares_its_work_and_weighting(name: str) -> None:
    config = parse_algorithm_config(name, {"local_epochs": 3})
    assert config.work_epochs() == 3  # a simulated job lasts its local epochs
    assert not config.weighs_equally()  # by samples unless told otherwise


def test_uniform_weights_are_declared_equal() -> None:
    assert FedAvgConfig(aggregation_weights="uniform").weighs_equally()
