"""A device over its limit of dropped messages sits out the rest of the round, then comes back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from coordinator.engine.quarantine import Quarantine
from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.stages.aggregate_guard import GuardSettings
from coordinator.strategies import build_strategy
from protocols import topics
from protocols.algorithms import FedAvgConfig
from protocols.codec import decode_frame, encode_frame
from protocols.messages import EvaluationReport, FleetRow, RoundAnnouncement
from protocols.transport.inprocess import InProcessBroker
from tests.coordinator.test_robust_aggregate import RUN, ScriptedFleet, update_frame
from tests.wiretap import decoded_into


def test_drops_past_the_limit_quarantine_until_the_next_round() -> None:
    quarantine = Quarantine(limit=3)
    quarantine.start_round(1, {"a": 10})
    assert quarantine.holds("a", 13) == (False, False)  # 3 this round: at the limit
    assert quarantine.holds("a", 14) == (True, True)
    assert quarantine.holds("a", 14) == (True, False)
    assert quarantine.holds("b", 2) == (False, False)
    assert quarantine.held() == {"a"}
    quarantine.start_round(2, {"a": 14})
    assert quarantine.held() == frozenset()
    assert quarantine.holds("a", 15) == (False, False)
    assert Quarantine(limit=0).holds("a", 10**6) == (False, False)


def test_a_device_over_its_limit_is_ignored_for_the_round_and_shown_in_the_status() -> None:
    # Prepare: two honest devices and one that sends garbage before its (valid) update
    broker = InProcessBroker()
    coordinator = Coordinator(
        broker.connect("coordinator"),
        build_strategy(FedAvgConfig(), 1.0),
        {"w": torch.zeros(3)},
        EngineSettings(rounds=2, quorum=0.5, guard=GuardSettings(quarantine_after=5)),
    )
    coordinator.run_id = RUN
    sent_garbage: list[int] = []

    def noisy(round_id: int, device_id: str) -> bytes:
        if round_id == 1:
            update = topics.device("default", device_id, "update")
            for _ in range(10):
                broker.connect("noisy-raw").publish(update, b"garbage")
            sent_garbage.append(round_id)
        return update_frame(round_id, device_id, [30.0, 30.0, 30.0])

    fleet = ScriptedFleet(
        broker,
        {
            "dev-a": lambda r, d: update_frame(r, d, [1.0, 2.0, 3.0]),
            "dev-b": lambda r, d: update_frame(r, d, [3.0, 2.0, 1.0]),
            "noisy": noisy,
        },
    )
    rows: list[FleetRow] = []
    watcher = broker.connect("watcher")
    watcher.subscribe(topics.fleet_row("default"), decoded_into(FleetRow, rows))
    coordinator.start()
    fleet.hello()
    assert coordinator.wait_for_devices(3, 1.0)
    # Execute
    first = coordinator.run_round()
    broker.pump(lambda: False)  # deliver the fleet status published on quarantine
    during = [r.device for r in rows if r.device.quarantined]
    second = coordinator.run_round()
    # Assert: round 1 closed on the honest pair without waiting for the noisy device's update,
    # which was ignored; the status showed it quarantined; it took part again in round 2
    assert sent_garbage == [1]
    assert first.participants == 2
    assert during
    assert {d.device_id for d in during} == {"noisy"}
    assert second.participants == 3
    assert coordinator.quarantine.held() == frozenset()


def test_the_evaluation_after_a_quarantine_does_not_wait_for_the_quarantined_device() -> None:
    # Prepare: round 1 quarantines "noisy"; the honest pair answers every evaluation
    broker = InProcessBroker()
    transport = broker.connect("coordinator")
    coordinator = Coordinator(
        transport,
        build_strategy(FedAvgConfig(), 1.0),
        {"w": torch.zeros(3)},
        EngineSettings(rounds=1, quorum=0.5, guard=GuardSettings(quarantine_after=5)),
    )
    coordinator.run_id = RUN

    def noisy(round_id: int, device_id: str) -> bytes:
        raw = broker.connect("noisy-raw")
        for _ in range(10):
            raw.publish(topics.device("default", device_id, "update"), b"garbage")
        return update_frame(round_id, device_id, [30.0, 30.0, 30.0])

    honest = {d: lambda r, d: update_frame(r, d, [1.0, 2.0, 3.0]) for d in ("dev-a", "dev-b")}
    fleet = ScriptedFleet(broker, {**honest, "noisy": noisy})
    evaluator = broker.connect("evaluator")

    def evaluate(_topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        if announcement.phase != "evaluate":
            return
        for device_id in [*honest, "noisy"]:
            report = EvaluationReport(
                run_id=RUN,
                round_id=announcement.round_id,
                device_id=device_id,
                metric_name="accuracy",
                personalized=0.5,
                num_test_samples=10,
                num_train_samples=10,
            )
            topic = topics.device("default", device_id, "evaluation")
            evaluator.publish(topic, encode_frame(report))

    evaluator.subscribe(topics.round_announcement("default"), evaluate)
    settled: list[bool] = []
    wait_until = transport.wait_until

    def recording_wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
        settled.append(wait_until(predicate, timeout_s))
        return settled[-1]

    transport.wait_until = recording_wait  # type: ignore[method-assign]
    coordinator.start()
    fleet.hello()
    assert coordinator.wait_for_devices(3, 1.0)
    # Execute: a round that quarantines "noisy", then the evaluation within the same round
    record = coordinator.run_round()
    reports, _ = coordinator.evaluate()
    # Assert: the evaluation settled on the honest pair's reports, the held device's dropped;
    # over a real broker an unsettled wait would have lasted the whole round deadline
    assert record.participants == 2
    assert coordinator.quarantine.held() == {"noisy"}
    assert [r.device_id for r in reports] == ["dev-a", "dev-b"]
    assert settled[-1] is True
