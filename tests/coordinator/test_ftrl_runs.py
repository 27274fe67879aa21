"""DP-FTRL in the coordinator: the model is the FTRL iterate, the limit holds, a simulation runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.stages.accountant import DpRound
from coordinator.stages.ftrl import TreeNoise
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.tree_accountant import TreeAccountant
from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from protocols.algorithms import parse_algorithm_config
from protocols.privacy import PrivacySettings, clip_to_norm, noise_generator

TREE = {"mechanism": "ftrl-tree", "sampling": "fixed"}


def _fleet(n: int) -> FleetSnapshot:
    return FleetSnapshot(tuple(DeviceInfo(f"dev-{i}", 10, True) for i in range(n)))


def test_the_model_is_the_ftrl_iterate_of_the_noisy_prefix_sums() -> None:
    """theta_t = theta_0 + lr * (sum of clipped sums to t + z C * tree prefix noise) / m."""
    z, clip, lr = 0.7, 1.0, 0.5
    settings = PrivacySettings(noise_multiplier=z, clip_norm=clip, **TREE)  # type: ignore[arg-type]
    engine = PrivacyEngine(settings, participation=1.0, reproducible_seed=7)
    strategy = build_strategy(parse_algorithm_config("fedavg", {"server_lr": lr}), 1.0)
    reference = TreeNoise(7)
    theta0 = torch.zeros(3)
    model, clipped_prefix = theta0.clone(), torch.zeros(3, dtype=torch.float64)
    fleet = _fleet(4)
    for t in range(1, 8):
        deltas = [{"w": torch.tensor([float(i + t), -1.0, 0.5 * i])} for i in range(3)]
        engine.plan(fleet, ["dev-0", "dev-1", "dev-2"])  # m = 3, the cohort as selected
        updates = [ReceivedUpdate(f"dev-{i}", 5, 0.1, d) for i, d in enumerate(deltas)]
        shared = {"w": model}
        model = strategy.aggregate(t, shared, engine.privatize(updates, shared)).shared["w"]
        engine.finish([None] * 3)
        clipped_prefix += sum(clip_to_norm(d, clip)["w"].double() for d in deltas)
        noise = z * clip * reference.prefix_noise(t, {"w": theta0})["w"]
        expected = theta0.double() + lr * (clipped_prefix + noise) / 3
        torch.testing.assert_close(model.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_device_at_its_limit_sits_out_the_rest_of_its_tree() -> None:
    settings = PrivacySettings(tree_participations=1, tree_restart=2, **TREE)  # type: ignore[arg-type]
    engine = PrivacyEngine(settings, participation=1.0, reproducible_seed=1)
    shared = {"w": torch.zeros(1)}
    online = []
    for _ in range(4):
        cohort = engine.cohort(_fleet(3), rng=None)  # type: ignore[arg-type]
        online.append(cohort.online())
        engine.plan(cohort, ["dev-0"])
        engine.privatize([ReceivedUpdate("dev-0", 1, 0.0, {"w": torch.ones(1)})], shared)
        engine.finish([None])
    names = [set(devices) for devices in online]
    assert names == [{"dev-0", "dev-1", "dev-2"}, {"dev-1", "dev-2"}] * 2
    assert engine.report()["tree_participations"] == 1


def _simulate(**options: object) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    base = {"task": "digits", "devices": 8, "rounds": 5, "workers": 1, "seed": 3}
    settings = SimulationSettings.load(
        None, **{**base, **options}, dp_noise=2.0, dp_mechanism="ftrl-tree"
    )
    result = run_simulation(settings)
    assert result.summary.privacy is not None
    return dict(result.summary.privacy), [r.as_json() for r in result.records]


@pytest.mark.slow
def test_a_simulation_reports_the_tree_accountants_epsilon_every_round() -> None:
    """Half the fleet a round, each device in at most 2 rounds of each tree of 4."""
    privacy, records = _simulate(
        participation=0.5, dp_options={"tree_restart": 4, "tree_participations": 2}
    )
    independent = TreeAccountant(1e-5, 4, 2)
    for record in records:
        scalars = record["scalars"]
        assert isinstance(scalars, dict)
        spent = independent.record(DpRound(2.0, 8, 8.0))
        assert scalars["dp_epsilon"] == pytest.approx(spent.tighter)
        assert scalars["dp_epsilon_rdp"] == pytest.approx(spent.rdp)
        assert record["participants"] == record["selected"]
    selected = [r["selected"] for r in records]
    assert selected[:2] == [4, 4]  # half of everyone while nobody is at the limit
    assert selected[2] < 4  # then half of those below it
    assert selected[4] == 4  # a new tree: everyone again
    assert privacy["mechanism"] == "ftrl-tree"
    assert privacy["rounds_released"] == 5
    assert privacy["sampling"] == "fixed"


@pytest.mark.slow
def test_fedalt_after_pretraining_keeps_the_tree_when_fewer_tensors_are_shared() -> None:
    """Pretraining shares every tensor, FedAlt then only the global part: the tree goes on."""
    privacy, records = _simulate(
        algorithm="fedalt", rounds=2, pretrain_rounds=2, personal_preset="output"
    )
    assert privacy["rounds_released"] == 4
    assert all(r["scalars"]["dp_epsilon"] > 0 for r in records)


def test_dp_fedavg_draws_its_update_and_count_noise_from_one_stream() -> None:
    """The update's noise then the adaptive count's, from one seeded generator.

    Never two generators seeded alike, whose count noise would repeat the update's first draw.
    """
    settings = PrivacySettings(
        noise_multiplier=1.0, sampling="fixed", adaptive_clipping=True, quantile_noise=0.5
    )
    engine = PrivacyEngine(settings, participation=1.0, reproducible_seed=7)
    device = engine.plan(_fleet(2), ["dev-0", "dev-1"])
    shared = {"w": torch.zeros(5)}
    updates = [ReceivedUpdate(f"dev-{i}", 1, 0.0, {"w": torch.zeros(5)}) for i in range(2)]
    engine.privatize(updates, shared)
    fraction = engine.finish([0.5, 0.5])["dp_within_clip"]
    stream = noise_generator(7)
    torch.randn(5, generator=stream, dtype=torch.float64)  # the update's noise, drawn first
    count = 1.0 + 0.5 * 2 * float(torch.randn((), generator=stream, dtype=torch.float64))
    assert device.indicator_std == 0.0  # coordinator placement: the count noise is added here
    assert fraction == pytest.approx(count / 2 + 0.5)
