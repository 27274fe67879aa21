"""A synchronous round's call for work expires (MQTT 5) twice its deadline after it went out."""

from __future__ import annotations

from coordinator.dashboard.feeds import ViewTap
from coordinator.engine.round_types import ANNOUNCEMENT_LIFETIME
from coordinator.engine.rounds import EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.transport.base import Transport, TransportWrapper, publish_expiring
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import TASK, hub_agents

DEADLINE_S = 7.5


class ExpiryLog(TransportWrapper):
    """The coordinator's transport, noting every message published with an expiry."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.expiring: list[tuple[str, int]] = []

    def publish_expiring(
        self, topic: str, payload: bytes, *, retain: bool = False, expiry_s: int
    ) -> None:
        self.expiring.append((topic, expiry_s))
        super().publish_expiring(topic, payload, retain=retain, expiry_s=expiry_s)


def test_round_and_evaluation_calls_expire_and_the_final_one_stays() -> None:
    # Arrange
    broker = InProcessBroker()
    settings = SimulationSettings.load(None, task=TASK, algorithm="fedavg", devices=2)
    task = load_task(TASK)
    model = task.build_model(0)
    logged: list[ExpiryLog] = []

    def connect() -> ExpiryLog:
        logged.append(ExpiryLog(broker.connect("coordinator")))
        return logged[-1]

    engine = EngineSettings(task=TASK, rounds=1, quorum=1.0, round_timeout_s=DEADLINE_S, seed=1)
    coordinator = build_coordinator(connect, plan_stages(settings, task, model), model, engine)
    coordinator.start()
    hub_agents(broker, ["dev-0", "dev-1"])
    assert coordinator.wait_for_devices(2, 5.0)

    # Act
    record = coordinator.run_round()
    coordinator.evaluate()
    coordinator.evaluate(final=True)

    # Assert: the training call and the interim evaluation's expire, the final call does not
    assert record.participants == 2
    lifetime = int(ANNOUNCEMENT_LIFETIME * DEADLINE_S)
    announcements = topics.round_announcement("default")
    assert logged[0].expiring == [(announcements, lifetime), (announcements, lifetime)]


def test_the_dashboards_tap_files_an_expiring_message_as_a_plain_one() -> None:
    # Arrange: the engine's transport tapped for a board
    broker = InProcessBroker()
    filed: list[str] = []
    status = topics.coordinator_status("default")
    with ViewTap(
        broker.connect("pfl-coord-default"), "default", lambda t, _: filed.append(t)
    ) as tap:
        # Act
        publish_expiring(tap, status, b"a view topic", retain=True, expiry_s=5)
    # Assert: the board got it, as it gets what `publish` sends
    assert filed == [status]
