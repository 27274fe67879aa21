"""DP with buffered asynchronous aggregation: each aggregation a release, accounted unsampled.

An aggregation holds at most one update per device (a device works at most once per model
version), each clipped to C on its device and again here after its staleness and fair-share
weights (at most 1); the noised sum is divided by the buffer size K and each aggregation is a
Gaussian mechanism of replace-one sensitivity 2C with no sampling amplification, composed over
the aggregations released. A resumed engine: tests/coordinator/test_dp_checkpoint.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import dp_accounting
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant as pld
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.scheduling.staleness import StalenessRule
from coordinator.stages.accountant import RDP_ORDERS
from coordinator.stages.features import ASYNC_POISSON, ASYNC_TREE_LIMIT
from coordinator.stages.privacy import PrivacyEngine
from coordinator.strategies.base import ReceivedUpdate
from protocols.privacy import PrivacySettings, update_norm

ASYNC_DP: dict[str, Any] = {
    "task": "sine",
    "devices": 4,
    "seed": 0,
    "workers": 1,
    "mode": "async",
    "buffer": 2,
    "dp_noise": 1.0,
}
DELTA = 1e-5


def _independent_epsilons(z: float, releases: int) -> tuple[float, float]:
    """(RDP, PLD) epsilon of `releases` unsampled Gaussians of multiplier z, sensitivity 2C.

    RDP from the closed form alpha * (2C)^2 / (2 (zC)^2) = 2 alpha / z^2 per release,
    converted by dp-accounting at the project's orders; PLD by dp-accounting's own
    replace-one Gaussian (which doubles the sensitivity itself).
    """
    renyi = [releases * 2 * order / z**2 for order in RDP_ORDERS]
    eps_rdp, _ = rdp.compute_epsilon(RDP_ORDERS, renyi, DELTA)
    loss = pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    loss.compose(dp_accounting.GaussianDpEvent(z), releases)
    return float(eps_rdp), float(loss.get_epsilon(DELTA))


def test_an_async_dp_run_spends_the_unsampled_gaussians_of_its_aggregations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: every update that reaches the privacy stage, before its own clip
    clip = 0.01
    norms: list[float] = []
    privatize = PrivacyEngine.privatize

    def seen(
        engine: PrivacyEngine, updates: Sequence[ReceivedUpdate], *args: Any, **kwargs: Any
    ) -> list[ReceivedUpdate]:
        norms.extend(update_norm(u.shared_delta) for u in updates)
        return privatize(engine, updates, *args, **kwargs)

    monkeypatch.setattr(PrivacyEngine, "privatize", seen)
    settings = SimulationSettings.load(None, **ASYNC_DP, rounds=3, dp_clip=clip)
    # Execute
    result = run_simulation(settings)
    # Assert
    privacy = result.summary.privacy
    assert privacy is not None
    assert privacy["sampling"] == "fixed"  # the default under --mode async
    assert privacy["rounds_released"] == 3
    eps_rdp, eps_pld = _independent_epsilons(1.0, 3)
    assert privacy["epsilon_rdp"] == pytest.approx(eps_rdp, rel=1e-9)
    assert privacy["epsilon_pld"] == pytest.approx(eps_pld, rel=1e-3)
    assert privacy["epsilon"] == min(privacy["epsilon_rdp"], privacy["epsilon_pld"])
    assert privacy["epsilon_vs_fleet"] == privacy["epsilon"]  # no sample to see through
    records = [r.as_json() for r in result.records]
    assert [r["participants"] for r in records] == [2, 2, 2]
    assert all(r["train_loss"] is None for r in records)  # devices do not report it under DP
    assert all(r["scalars"]["dp_noise_multiplier"] == 1.0 for r in records)
    # each device clipped as its announcement said, weights at most 1 keep it within C
    assert len(norms) == 6
    assert max(norms) <= clip * (1 + 1e-5)
    assert any(n == pytest.approx(clip, rel=1e-4) for n in norms)  # the clip bound them


def test_an_async_dp_run_stops_before_passing_its_budget() -> None:
    eps_two, eps_three = (min(_independent_epsilons(1.0, t)) for t in (2, 3))
    budget = (eps_two + eps_three) / 2
    settings = SimulationSettings.load(None, **ASYNC_DP, rounds=5, dp_epsilon=budget)
    result = run_simulation(settings)
    privacy = result.summary.privacy
    assert privacy is not None
    assert len(result.records) == 2
    assert privacy["rounds_released"] == 2
    assert privacy["epsilon"] <= budget


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"dp_sampling": "poisson"}, ASYNC_POISSON),
        (
            {"dp_mechanism": "ftrl-tree", "dp_options": {"tree_participations": 1}},
            ASYNC_TREE_LIMIT,
        ),
    ],
    ids=["poisson", "tree_participations"],
)
def test_what_async_dp_cannot_account_for_is_refused_with_the_reason(
    options: Mapping[str, Any], reason: str
) -> None:
    settings = SimulationSettings.load(None, **ASYNC_DP, rounds=2, **options)
    with pytest.raises(ValueError, match=f"^{re.escape(f'--mode async: {reason}')}$"):
        run_simulation(settings)


def _aggregation(engine: PrivacyEngine, values: Sequence[float], buffer: int) -> list[Any]:
    """One asynchronous aggregation of one update per value; what the strategy would see."""
    engine.plan_aggregation(buffer)
    updates = [ReceivedUpdate(f"dev-{i}", 1, 0.0, {"w": torch.full((4,), v)}) for i, v in
               enumerate(values)]  # fmt: skip
    private = engine.privatize(updates, {"w": torch.zeros(4)})
    engine.finish([None] * len(updates))
    return [u.shared_delta["w"] for u in private]


def test_an_aggregation_divides_the_clipped_sum_by_the_buffer_not_by_who_came() -> None:
    engine = PrivacyEngine(PrivacySettings(noise_multiplier=0.0, sampling="fixed"), 1.0, 0)
    told = engine.plan_aggregation(4)
    assert told.clip_norm == 1.0
    assert told.noise_std == 0.0  # the coordinator adds the noise
    # two of four slots, each delta of norm 20 clipped to 1: the mean is their sum over 4
    private = _aggregation(engine, [10.0, 10.0], 4)
    mean = sum(private) / len(private)
    assert torch.allclose(mean, torch.full((4,), 2 * 0.5 / 4))
    assert engine.accountant.rounds[-1].population == engine.accountant.rounds[-1].cohort == 4


def test_async_dp_plans_refuse_a_poisson_engine() -> None:
    engine = PrivacyEngine(PrivacySettings(sampling="poisson"), 1.0, 0)
    with pytest.raises(ValueError, match="draw no Poisson sample"):
        engine.plan_aggregation(2)


def test_the_budget_looks_ahead_to_an_unsampled_aggregation() -> None:
    # a fleet of 1000 at participation 0.1 would amplify a sampled round; an aggregation is not
    budget = min(_independent_epsilons(1.0, 1)) * 0.99
    tight = PrivacyEngine(PrivacySettings(sampling="fixed", target_epsilon=budget), 0.1, 0)
    assert tight.over_budget(1000) == ""  # a sampled round of 100 of 1000 fits
    tight.plan_aggregation(2)
    assert "over the budget" in tight.over_budget(1000)


@pytest.mark.parametrize("text", ["constant", "poly", "poly:2", "hinge", "hinge:0.5:1"])
def test_no_staleness_rule_weighs_an_update_above_one(text: str) -> None:
    rule = StalenessRule.parse(text)
    assert all(0 < rule.weight(s) <= 1 for s in range(100))


@pytest.mark.parametrize("values", [{"a": -0.5}, {"kind": "hinge", "b": -1.0}, {"a": math.nan}])
def test_a_staleness_rule_that_could_weigh_above_one_is_refused(values: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="finite and not negative"):
        StalenessRule(**values)
