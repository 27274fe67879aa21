"""A DP run's checkpoint holds its engine: the epsilon spent goes on, DP-FTRL's tree continues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.checkpoint import (
    Checkpoint,
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from coordinator.stages.ftrl import TreeNoise
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.privacy_stage import PrivacyStage
from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from protocols.algorithms import parse_algorithm_config
from protocols.errors import StateError
from protocols.privacy import PrivacySettings
from protocols.transport.inprocess import InProcessBroker

TREE = PrivacySettings(
    mechanism="ftrl-tree", sampling="fixed", tree_restart=4, tree_participations=2
)
FLEET = FleetSnapshot(tuple(DeviceInfo(f"dev-{i}", 10, True) for i in range(3)))


def _coordinator(privacy: PrivacyEngine | None) -> Coordinator:
    return Coordinator(
        InProcessBroker().connect("coord"),
        build_strategy(parse_algorithm_config("fedavg", {}), 1.0),
        {"w": torch.zeros(4)},
        EngineSettings(seed=1),
        stages=() if privacy is None else (PrivacyStage(privacy),),
    )


def _saved(directory: Path, privacy: PrivacyEngine | None) -> Checkpoint:
    """A run with `privacy` checkpointed in `directory`, read back."""
    save_checkpoint(directory, _coordinator(privacy), {})
    checkpoint = load_checkpoint(directory)
    assert checkpoint is not None
    return checkpoint


def _resumed(
    directory: Path, original: PrivacyEngine, settings: PrivacySettings, multiplier: float
) -> PrivacyEngine:
    """A new engine of `settings`, restored from `original`'s checkpoint."""
    checkpoint = _saved(directory, original)
    resumed = PrivacyEngine(settings, multiplier, None)
    restore_checkpoint(_coordinator(resumed), checkpoint)
    return resumed


def _plan(engine: PrivacyEngine, *, asynchronous: bool) -> None:
    """Plan a round of dev-0 and dev-1 (asynchronous: an aggregation of 2, unsampled)."""
    if asynchronous:
        engine.plan_aggregation(2)
    else:
        engine.plan(FLEET, ["dev-0", "dev-1"])


def _rounds(engine: PrivacyEngine, count: int, *, asynchronous: bool = False) -> None:
    shared = {"w": torch.zeros(4)}
    for _ in range(count):
        _plan(engine, asynchronous=asynchronous)
        updates = [ReceivedUpdate(d, 1, 0.0, {"w": torch.ones(4)}) for d in ("dev-0", "dev-1")]
        engine.privatize(updates, shared)
        engine.finish([None, None])


@pytest.mark.parametrize("settings", [TREE, PrivacySettings(sampling="fixed")])
def test_a_resumed_dp_run_goes_on_from_the_epsilon_it_spent(
    tmp_path: Path, settings: PrivacySettings
) -> None:
    # Prepare: 5 rounds; the serve engine's noise is unseeded, so the tree's seed must be kept
    original = PrivacyEngine(settings, 1.0, None)
    _rounds(original, 5)
    # Execute
    resumed = _resumed(tmp_path, original, settings, 1.0)
    # Assert
    assert resumed.accountant.rounds == original.accountant.rounds
    assert resumed.epsilon == original.epsilon > 0
    _rounds(resumed, 1)
    _rounds(original, 1)
    assert resumed.epsilon == pytest.approx(original.epsilon)
    assert resumed.spent_vs_fleet == original.spent_vs_fleet  # the devices' rounds came back


def test_a_resumed_discrete_gaussian_run_keeps_its_ring_rounds(tmp_path: Path) -> None:
    # the ring's accountant is not the Gaussian's: a ring round read back as a plain multiplier
    # would be amplified by Poisson sampling as a Gaussian, and spend less than it did
    settings = PrivacySettings(placement="device", distribution="discrete-gaussian")
    original = PrivacyEngine(settings, 0.5, None)
    for _ in range(3):
        original.plan(FLEET, ["dev-0", "dev-1"])
        original.finish([None], reporters=2)
    assert all(r.ring is not None for r in original.accountant.rounds)
    resumed = _resumed(tmp_path, original, settings, 0.5)
    assert resumed.accountant.rounds == original.accountant.rounds
    assert resumed.epsilon == original.epsilon > 0
    assert resumed.spent_vs_fleet == original.spent_vs_fleet


def test_a_resumed_tree_continues_the_same_tree_and_participation_counts(tmp_path: Path) -> None:
    original = PrivacyEngine(TREE, 1.0, None)
    _rounds(original, 5)  # round 5 opened the second tree, where dev-0 and dev-1 joined once
    resumed = _resumed(tmp_path, original, TREE, 1.0)
    before, after = original.mechanism.noise, resumed.mechanism.noise
    assert isinstance(before, TreeNoise)
    assert isinstance(after, TreeNoise)
    assert after.rounds == before.rounds == 5
    shapes = {"w": torch.zeros(4)}
    for t in (4, 5):  # the nodes released before the checkpoint keep their noise
        assert torch.equal(after.prefix_noise(t, shapes)["w"], before.prefix_noise(t, shapes)["w"])
    _rounds(resumed, 1)  # dev-0 and dev-1 reach their limit of 2 in this tree
    assert resumed.cohort(FLEET, rng=None).online() == ["dev-2"]  # type: ignore[arg-type]


def test_a_dp_run_is_not_resumed_from_a_checkpoint_without_dp_state(tmp_path: Path) -> None:
    checkpoint = _saved(tmp_path, None)
    with pytest.raises(StateError, match="no privacy state"):
        restore_checkpoint(_coordinator(PrivacyEngine(TREE, 1.0, None)), checkpoint)
    checkpoint = _saved(tmp_path, PrivacyEngine(TREE, 1.0, None))
    other = PrivacyEngine(PrivacySettings(sampling="fixed"), 1.0, None)
    with pytest.raises(StateError, match="of mechanism 'ftrl-tree'"):
        restore_checkpoint(_coordinator(other), checkpoint)


def _released(engine: PrivacyEngine, *, asynchronous: bool = False) -> tuple[torch.Tensor, float]:
    """One more round: the noised update the strategy sees, and the clip adapted after it."""
    _plan(engine, asynchronous=asynchronous)
    updates = [ReceivedUpdate(d, 1, 0.0, {"w": torch.ones(4)}) for d in ("dev-0", "dev-1")]
    private = engine.privatize(updates, {"w": torch.zeros(4)})
    engine.finish([0.5, -0.5])
    return private[0].shared_delta["w"], engine.clip_norm


def test_a_resumed_dp_fedavg_run_draws_the_noise_the_uninterrupted_run_would(
    tmp_path: Path,
) -> None:
    # Prepare: unseeded noise (as `serve` runs it) and adaptive clipping, whose count is noised
    settings = PrivacySettings(sampling="fixed", adaptive_clipping=True, quantile_noise=0.5)
    original = PrivacyEngine(settings, 1.0, None)
    _rounds(original, 3)
    # Execute
    resumed = _resumed(tmp_path, original, settings, 1.0)
    # Assert: the same noise and the same clip, round after round
    for _ in range(2):
        (noised, clip), (again, clip_again) = _released(original), _released(resumed)
        assert torch.equal(noised, again)
        assert clip == clip_again
    assert resumed.epsilon == original.epsilon


def test_a_resumed_async_dp_run_goes_on_with_the_same_epsilon_and_noise(tmp_path: Path) -> None:
    # Prepare: three asynchronous aggregations, serve's unseeded noise
    original = PrivacyEngine(PrivacySettings(sampling="fixed"), 1.0, None)
    _rounds(original, 3, asynchronous=True)
    # Execute
    resumed = _resumed(tmp_path, original, original.settings, original.participation)
    # Assert: the aggregations accounted, then the same noise (the scheduler plans again)
    assert resumed.accountant.rounds == original.accountant.rounds
    (noised, _), (again, _) = (
        _released(original, asynchronous=True),
        _released(resumed, asynchronous=True),
    )
    assert torch.equal(noised, again)
    assert resumed.epsilon == original.epsilon > 0
    assert resumed.spent_vs_fleet == resumed.spent == original.spent_vs_fleet


def test_a_checkpoint_with_a_broken_noise_state_is_refused(tmp_path: Path) -> None:
    original = PrivacyEngine(PrivacySettings(sampling="fixed"), 1.0, None)
    save_checkpoint(tmp_path, _coordinator(original), {})
    record = tmp_path / "checkpoint.json"
    state = json.loads(record.read_text())
    state["stages"]["privacy"]["generator"] = "not base64!"
    record.write_text(json.dumps(state))
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint is not None
    resumed = PrivacyEngine(PrivacySettings(sampling="fixed"), 1.0, None)
    with pytest.raises(StateError, match="not a noise generator's state"):
        restore_checkpoint(_coordinator(resumed), checkpoint)
