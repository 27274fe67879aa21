"""The simulated attacks send what their papers say, and honest devices are untouched."""

from __future__ import annotations

import statistics
from typing import get_args

import pytest
import torch

from coordinator.run.settings import SimulatedAttack, SimulationSettings
from coordinator.run.simulate import attack_plan
from device_agent.algorithms.base import LocalResult
from device_agent.attacks import (
    ATTACKS,
    FREE_RIDER_SAMPLES,
    HONEST,
    AttackName,
    AttackPlan,
    Coalition,
    DeviceAttack,
    alie_z,
)
from pfl_tasks.base import DeviceData, Split


def _result(values: list[float], samples: int = 30) -> LocalResult:
    delta = {"w": torch.tensor(values), "n": torch.tensor(3)}
    return LocalResult(delta, samples, 0.5, {"head": torch.ones(2)})


def _attack(
    name: AttackName, strength: float = 1.0, coalition: Coalition | None = None
) -> DeviceAttack:
    return DeviceAttack(name, "dev-0001", strength, coalition or Coalition(), classes=10)


def test_the_honest_null_object_changes_nothing() -> None:
    result = _result([1.0, -2.0])
    data = DeviceData(0, *(Split(torch.zeros(2, 3), torch.tensor([1, 2])),) * 3)
    assert HONEST.forge(result) is result
    assert HONEST.train_data(data) is data
    assert HONEST.declared_samples(17) == 17


@pytest.mark.parametrize(
    ("name", "strength", "expected"),
    [
        ("sign-flip", 1.0, [-1.0, 2.0]),
        ("scaling", 100.0, [100.0, -200.0]),
        ("free-rider", 1.0, [0.0, 0.0]),
    ],
)
def test_per_device_attacks_forge_the_delta_and_keep_counters_and_personal_state(
    name: AttackName, strength: float, expected: list[float]
) -> None:
    forged = _attack(name, strength).forge(_result([1.0, -2.0]))
    torch.testing.assert_close(forged.shared_delta["w"], torch.tensor(expected))
    assert int(forged.shared_delta["n"]) == 3
    torch.testing.assert_close(forged.personal["head"], torch.ones(2))
    assert forged.num_samples == (FREE_RIDER_SAMPLES if name == "free-rider" else 30)


def test_alie_and_ipm_use_the_coalitions_honest_updates() -> None:
    coalition = Coalition()
    first = _attack("alie", 1.5, coalition)
    second = DeviceAttack("alie", "dev-0002", 1.5, coalition, 10)
    alone = first.forge(_result([1.0, 4.0]))  # one honest update: no spread, its own mean
    torch.testing.assert_close(alone.shared_delta["w"], torch.tensor([1.0, 4.0]))
    both = second.forge(_result([3.0, 4.0]))
    # mean (2, 4), population std (1, 0): mean - 1.5 std
    torch.testing.assert_close(both.shared_delta["w"], torch.tensor([0.5, 4.0]))
    ipm = DeviceAttack("ipm", "dev-0003", 0.1, coalition, 10)
    sent = ipm.forge(_result([5.0, -8.0]))  # mean of (1, 4), (3, 4), (5, -8) is (3, 0)
    torch.testing.assert_close(sent.shared_delta["w"], torch.tensor([-0.3, 0.0]))


def test_alie_z_is_the_papers_z_max() -> None:
    # n = 20, m = 2: s = floor(11) - 2 = 9, z = Phi^-1(11 / 20); m = 5: s = 6, Phi^-1(14 / 20)
    assert alie_z(20, 2) == pytest.approx(statistics.NormalDist().inv_cdf(0.55))
    assert alie_z(20, 5) == pytest.approx(statistics.NormalDist().inv_cdf(0.7))


def test_label_flip_flips_the_training_labels_only() -> None:
    split = Split(torch.zeros(3, 2), torch.tensor([0, 4, 9]))
    data = DeviceData(0, split, split, split)
    flipped = _attack("label-flip").train_data(data)
    assert flipped.train.targets.tolist() == [9, 5, 0]
    assert flipped.test.targets.tolist() == [0, 4, 9]


def test_the_plan_draws_the_fraction_from_the_seed_and_refuses_nonsense() -> None:
    plan = AttackPlan.draw("sign-flip", 0.25, 20, 0, None)
    assert len(plan.malicious) == 5
    assert plan == AttackPlan.draw("sign-flip", 0.25, 20, 0, None)
    assert plan.malicious != AttackPlan.draw("sign-flip", 0.25, 20, 1, None).malicious
    assert AttackPlan.draw("alie", 0.1, 20, 0, None).strength == pytest.approx(alie_z(20, 2))
    assert AttackPlan.draw("scaling", 0.1, 20, 0, None).strength == 100.0
    outsider = next(i for i in range(20) if i not in plan.malicious)
    assert plan.attack(outsider, "x", Coalition(), 10) is HONEST
    with pytest.raises(ValueError, match="unknown attack"):
        AttackPlan.draw("bribe", 0.1, 20, 0, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fraction"):
        AttackPlan.draw("ipm", 1.0, 20, 0, None)


def test_the_settings_name_every_attack_and_need_both_options() -> None:
    assert set(get_args(SimulatedAttack)) == {"none", *ATTACKS}
    with pytest.raises(ValueError, match="malicious-fraction"):
        attack_plan(SimulationSettings.load(None, attack="ipm"))
    with pytest.raises(ValueError, match="needs an --attack"):
        attack_plan(SimulationSettings.load(None, malicious_fraction=0.1))
    assert attack_plan(SimulationSettings.load(None)) is None
