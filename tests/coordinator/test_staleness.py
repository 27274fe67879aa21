"""Staleness weights against FedAsync's closed forms, and what scaling does to an update."""

from __future__ import annotations

import pytest
import torch

from coordinator.scheduling.staleness import StalenessRule, weigh_update
from coordinator.strategies.base import ReceivedUpdate


@pytest.mark.parametrize("a", [0.5, 1.0, 2.0])
def test_polynomial_weight_is_one_over_one_plus_s_to_the_a(a: float) -> None:
    rule = StalenessRule.parse(f"poly:{a}")
    assert [rule.weight(s) for s in range(12)] == pytest.approx([(1 + s) ** -a for s in range(12)])


def test_hinge_weight_is_flat_up_to_b_then_falls_as_one_over_a_times_excess_plus_one() -> None:
    rule = StalenessRule.parse("hinge:2:3")
    expected = [1.0, 1.0, 1.0, 1.0, 1 / 3, 1 / 5, 1 / 7, 1 / 9]
    assert [rule.weight(s) for s in range(8)] == pytest.approx(expected)


def test_constant_weight_ignores_staleness_and_defaults_follow_the_papers() -> None:
    assert {StalenessRule.parse("constant").weight(s) for s in range(20)} == {1.0}
    assert StalenessRule.parse("poly") == StalenessRule("polynomial", 0.5)  # FedBuff's 1/sqrt(1+s)
    assert StalenessRule.parse("hinge") == StalenessRule("hinge", 10.0, 4.0)
    assert str(StalenessRule.parse("HINGE:2")) == "hinge:2:4"


@pytest.mark.parametrize(
    "text", ["", "linear", "poly:x", "poly:1:2", "hinge:-1", "constant:1", "poly:nan"]
)
def test_a_malformed_rule_is_refused_with_the_forms_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match="staleness"):
        StalenessRule.parse(text)


def test_negative_staleness_is_an_error_not_a_bonus() -> None:
    with pytest.raises(ValueError, match="negative"):
        StalenessRule().weight(-1)


def test_weighing_scales_only_the_delta_and_keeps_a_fresh_update_as_it_is() -> None:
    update = ReceivedUpdate("dev-1", 7, 0.5, {"w": torch.tensor([1.0, -2.0]), "b": torch.ones(1)})
    scaled = weigh_update(update, 0.25)
    assert torch.equal(scaled.shared_delta["w"], torch.tensor([0.25, -0.5]))
    assert torch.equal(scaled.shared_delta["b"], torch.tensor([0.25]))
    assert (scaled.num_samples, scaled.train_loss, scaled.device_id) == (7, 0.5, "dev-1")
    assert weigh_update(update, 1.0) is update
