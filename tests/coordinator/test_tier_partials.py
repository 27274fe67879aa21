"""The coordinator's tier path: partial aggregates are checked like updates, then combined."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from coordinator.stages.uplink import UplinkRound
from coordinator.strategies.base import RoundPlan
from coordinator.tier import wire
from coordinator.tier.uplink import TierUplink
from protocols.algorithms import parse_algorithm_config
from protocols.codec import describe_tensors
from protocols.errors import RoundError
from protocols.transport.inprocess import InProcessBroker

FLEET = "f"
SHAPE = {"w": torch.zeros(2, 2, dtype=torch.float32)}
SPECS = describe_tensors(SHAPE)
DEVICES = ("d1", "d2", "d3", "d4")
SAMPLES = {"d1": 10, "d2": 30, "d3": 20, "d4": 40}


@dataclass
class _Registry:
    def declared_samples(self, device_id: str) -> int | None:
        return SAMPLES.get(device_id)

    def online_ids(self) -> frozenset[str]:
        return frozenset(DEVICES)


@dataclass
class _Strategy:
    name: str = "fedavg"
    config: Any = field(default_factory=lambda: parse_algorithm_config("fedavg", {}))


@dataclass
class _Settings:
    round_timeout_s: float = 0.05


@dataclass
class _Host:
    """What the tier path reads of the engine; `announce` publishes the test's partials."""

    send: Callable[[], None]
    run_id: str = "run1"
    strategy: _Strategy = field(default_factory=_Strategy)
    settings: _Settings = field(default_factory=_Settings)
    registry: _Registry = field(default_factory=_Registry)
    specs: tuple[Any, ...] = SPECS

    def announce(self, *args: Any, **kwargs: Any) -> None:
        self.send()


def _partial(
    aggregator: str, devices: tuple[str, ...], value: float, **changes: Any
) -> tuple[wire.PartialAggregate, dict[str, torch.Tensor]]:
    weight = float(sum(SAMPLES.get(d, 1) for d in devices))
    fields: dict[str, Any] = {
        "run_id": "run1",
        "round_id": 1,
        "aggregator": aggregator,
        "devices": devices,
        "weight": weight,
        "loss_sum": 0.5 * weight,
        "samples": int(weight),
        **changes,
    }
    sums = {"w": torch.full((2, 2), value * weight, dtype=torch.float64)}
    return wire.PartialAggregate(**fields), sums


def _collect(frames: list[tuple[str, bytes]], needed: int = 1) -> tuple[Any, TierUplink]:
    hub = InProcessBroker()
    sender = hub.connect("aggregators")
    path = TierUplink(hub.connect("coordinator"), FLEET, ["a", "b"], clip_norm=10.0, grace_s=0.05)

    def send() -> None:
        for topic, payload in frames:
            sender.publish(topic, payload)

    request = UplinkRound(1, RoundPlan(DEVICES), needed, None, len(DEVICES))
    return path.collect(_Host(send), request), path  # type: ignore[arg-type]


def _frame(aggregator: str, devices: tuple[str, ...], value: float, **changes: Any):
    partial, sums = _partial(aggregator, devices, value, **changes)
    return wire.partial_topic(FLEET, aggregator), wire.encode(partial, sums)


def test_two_partials_combine_into_the_weighted_mean_of_every_update() -> None:
    # Execute: group a's devices each moved 1.0, group b's 4.0
    collected, path = _collect([_frame("a", ("d1", "d2"), 1.0), _frame("b", ("d3", "d4"), 4.0)])
    # Assert: (40 x 1 + 60 x 4) / 100
    (update,) = collected.updates
    assert torch.allclose(update.shared_delta["w"], torch.full((2, 2), 2.8))
    assert update.shared_delta["w"].dtype == torch.float32
    assert (collected.participants, collected.presummed, update.num_samples) == (4, True, 100)
    assert collected.scalars == {"tier_partials": 2.0, "tier_missing": 0.0}
    assert path.rejected == []


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        (("c", ("d1", "d2"), 1.0, {}), "not one of this run's"),
        (("a", ("d1", "d2"), 1.0, {"round_id": 2}), "stale partial"),
        (("a", ("d1", "d2"), 1.0, {"run_id": "other"}), "stale partial"),
        (("a", ("d1", "d9"), 1.0, {}), "not asked this round"),
        (("a", ("d2", "d1"), 1.0, {}), "sorted and each listed once"),
        (("a", ("d1", "d2"), 1.0, {"weight": 1e6}), "devices declared 40"),
        (("a", ("d1", "d2"), 1.0, {"samples": 41}), "devices declared 40"),
        (("a", ("d1", "d2"), 100.0, {}), "over weight x clip"),
    ],
)
def test_a_forged_partial_is_dropped_whole_and_the_honest_one_counts(
    forged: tuple[str, tuple[str, ...], float, dict[str, Any]], reason: str
) -> None:
    # Prepare
    name, devices, value, changes = forged
    frames = [_frame(name, devices, value, **changes), _frame("a", ("d1", "d2"), 1.0)]
    # Execute
    collected, path = _collect([*frames, _frame("b", ("d3", "d4"), 1.0)])
    # Assert
    assert len(path.rejected) == 1
    assert reason in path.rejected[0]
    assert collected.participants == 4


def test_a_replayed_or_overlapping_partial_is_refused() -> None:
    # Execute: a's partial sent twice, then b claiming a's device
    collected, path = _collect(
        [
            _frame("a", ("d1", "d2"), 1.0),
            _frame("a", ("d1", "d2"), 1.0),
            _frame("b", ("d2", "d3"), 1.0),
        ]
    )
    # Assert
    assert ["second partial" in r for r in path.rejected] == [True, False]
    assert "already covered" in path.rejected[1]
    assert collected.participants == 2


def test_a_topic_that_is_not_the_partials_aggregator_is_refused() -> None:
    partial, sums = _partial("a", ("d1", "d2"), 1.0)
    frames = [(wire.partial_topic(FLEET, "b"), wire.encode(partial, sums))]
    collected, path = _collect([*frames, _frame("b", ("d3", "d4"), 1.0)])
    assert "does not match its topic" in path.rejected[0]
    assert collected.participants == 2


def test_garbage_is_refused_without_stopping_the_round() -> None:
    collected, path = _collect(
        [(wire.partial_topic(FLEET, "a"), b"PFLT\xff\xff"), _frame("b", ("d3", "d4"), 1.0)]
    )
    assert "tier frame" in path.rejected[0]
    assert collected.participants == 2


def test_a_lost_aggregator_loses_its_group_and_the_round_meets_its_quorum() -> None:
    # Execute: only b answers
    collected, _ = _collect([_frame("b", ("d3", "d4"), 2.0)], needed=2)
    # Assert
    assert collected.participants == 2
    assert collected.scalars["tier_missing"] == 1.0
    assert torch.allclose(collected.updates[0].shared_delta["w"], torch.full((2, 2), 2.0))
    with pytest.raises(RoundError, match="cover 2 of 4 devices"):
        _collect([_frame("b", ("d3", "d4"), 2.0)], needed=3)
