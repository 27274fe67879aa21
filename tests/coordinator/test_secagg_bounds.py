"""A secure round's weight bound follows the weighting the algorithm's config declares."""

from __future__ import annotations

from coordinator.stages.secure.bounds import weight_bound
from coordinator.strategies.fedalt import FedAltStrategy
from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import FedAltConfig, FedAvgConfig

DECLARED = [40, None, 10, 30, 0]


def test_an_equally_weighted_mean_bounds_every_weight_at_one() -> None:
    uniform = FedAvgStrategy(FedAvgConfig(aggregation_weights="uniform"), participation=1.0)
    assert uniform.config.weighs_equally()
    assert weight_bound(uniform, DECLARED, private=False, max_share=0.5) == 1


def test_a_sample_weighted_mean_bounds_weights_at_the_largest_capped_count() -> None:
    by_samples = FedAvgStrategy(FedAvgConfig(), participation=1.0)
    assert not by_samples.config.weighs_equally()
    assert weight_bound(by_samples, DECLARED, private=False, max_share=0.5) == 40
    # water-filling at 0.4: T = 0.4 (10 + 2 T) caps the 40 and the 30 at 20
    assert weight_bound(by_samples, DECLARED, private=False, max_share=0.4) == 20


def test_an_algorithm_that_declares_no_equal_weighting_weighs_by_samples() -> None:
    fedalt = FedAltStrategy(FedAltConfig(), participation=1.0)
    assert not fedalt.config.weighs_equally()
    assert weight_bound(fedalt, DECLARED, private=False, max_share=1.0) == 40


def test_device_placed_privacy_bounds_every_weight_at_one() -> None:
    by_samples = FedAvgStrategy(FedAvgConfig(), participation=1.0)
    assert weight_bound(by_samples, DECLARED, private=True, max_share=0.5) == 1
