"""A device online but silent costs a round its deadline once; later rounds give it a grace."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.engine.silence import GRACE_SHARE
from coordinator.run.settings import SimulationSettings
from protocols import topics
from protocols.messages import RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import TASK, hub_agents, hub_engine, hub_impostor, record_waits, update_frame

DEADLINE_S = 2.0
SILENT = "dev-silent"


@dataclass
class Run:
    coordinator: Coordinator
    waits: list[tuple[float, bool]] = field(default_factory=list)
    """Each wait's timeout and whether it ended before it."""
    announcements: list[RoundAnnouncement] = field(default_factory=list)
    """What the silent device was asked (it never answers in time)."""
    silent: list[Transport] = field(default_factory=list)


def silent_fleet() -> Run:
    broker = InProcessBroker()
    settings = SimulationSettings.load(None, task=TASK, algorithm="fedavg", devices=3)
    coordinator = hub_engine(
        broker,
        settings,
        EngineSettings(task=TASK, rounds=5, quorum=0.5, round_timeout_s=DEADLINE_S, seed=1),
    )
    run = Run(coordinator)
    record_waits(coordinator, run.waits)
    coordinator.start()

    def keep_quiet(device: Transport, announcement: RoundAnnouncement) -> None:
        run.silent[:] = [device]
        run.announcements.append(announcement)

    hub_impostor(broker, SILENT, keep_quiet)
    hub_agents(broker, ["dev-0", "dev-1", "dev-2"])
    assert coordinator.wait_for_devices(4, 2.0)
    run.waits.clear()
    return run


def test_a_silent_device_costs_one_deadline_then_only_a_grace_until_heard_from() -> None:
    run = silent_fleet()
    # Execute / Assert: the first round waits its whole deadline for the silent device
    first = run.coordinator.run_round()
    assert first.participants == 3
    assert (DEADLINE_S, False) in run.waits
    # the next one ends a grace after the others are in
    run.waits.clear()
    second = run.coordinator.run_round()
    assert second.participants == 3
    assert (DEADLINE_S, False) not in run.waits
    assert (DEADLINE_S, True) in run.waits
    assert (DEADLINE_S * GRACE_SHARE, False) in run.waits
    # a late answer (a slow device, not a dead one) earns it the whole deadline again
    late = update_frame(run.announcements[-1], SILENT, {"w": torch.zeros(1)})
    run.silent[0].publish(topics.device("default", SILENT, "update"), late)
    run.coordinator.transport.wait_until(lambda: False, 0.2)  # delivered, dropped as late
    run.waits.clear()
    run.coordinator.run_round()
    assert (DEADLINE_S, False) in run.waits
