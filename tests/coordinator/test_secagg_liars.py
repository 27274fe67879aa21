"""A device that lies inside secure aggregation cannot stop the run or steer its model.

The round engine over the in-process hub, honest DeviceAgents (tests/hub_fleet.py) and one client
holding a device's identity that runs the real SecureClient with a twist: a garbage masked vector,
shares of another seed than it committed to, a huge declared data set, or leaving after its keys.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.engine.silence import GRACE_SHARE
from coordinator.run.pipeline import privacy_of
from coordinator.run.settings import SimulationSettings
from coordinator.stages.privacy import privacy_engine
from device_agent.agent import device_will
from device_agent.capabilities import probe_capabilities
from device_agent.secure_aggregation import SecureClient
from protocols import topics
from protocols.codec import decode_frame, encode_frame
from protocols.messages import (
    DeviceHello,
    DeviceStatus,
    Message,
    RoundAnnouncement,
    SecAggKeys,
    SecAggUnmask,
)
from protocols.secure_aggregation import MASKED_TENSOR, SecureAggregationSettings
from protocols.transport.inprocess import InProcessBroker, InProcessTransport
from tests.hub_fleet import TASK, hub_agents, hub_engine, record_waits, update_frame

FLEET = "default"
LIAR = "liar"
CLIP = 10.0


@dataclass
class Liar:
    """A device identity running secure aggregation's protocol with a twist."""

    samples: int = 10
    delta: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda shared: {
        name: torch.zeros_like(value) for name, value in shared.items()
    }
    masked: Callable[[np.ndarray], np.ndarray | None] = lambda vector: vector
    """What it sends instead of its masked vector (None: nothing, it drops out after dealing)."""
    after_keys: Callable[[Liar], None] = lambda liar: None
    silent: bool = False
    """Sends its keys each round, then nothing, while staying connected."""
    client: SecureClient | None = None
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    announcement: RoundAnnouncement | None = None
    transport: InProcessTransport = field(init=False)

    def start(self, transport: InProcessTransport, shared: dict[str, torch.Tensor]) -> None:
        self.transport, self.shared = transport, shared
        self.client = SecureClient(LIAR, self._publish_secure)
        self.transport.subscribe(topics.round_announcement(FLEET), self._on_round)
        self.transport.subscribe(topics.secure(FLEET), self._on_secure)
        self.transport.subscribe(topics.secure(FLEET, LIAR), self._on_secure)
        hello = DeviceHello(
            device_id=LIAR,
            task=TASK,
            num_train_samples=self.samples,
            capabilities=probe_capabilities(),
        )
        self.transport.publish(topics.device(FLEET, LIAR, "hello"), encode_frame(hello))

    def _publish_secure(self, message: Message) -> None:
        self.transport.publish(topics.device(FLEET, LIAR, "secagg"), encode_frame(message))
        if isinstance(message, SecAggKeys):
            self.after_keys(self)

    def _on_round(self, _topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        if announcement.phase != "train" or LIAR not in announcement.selected:
            return
        self.announcement = announcement
        assert self.client is not None
        self.client.join(announcement)

    def _on_secure(self, _topic: str, payload: bytes) -> None:
        if self.silent:
            return
        message, _ = decode_frame(payload)
        assert self.client is not None
        assert self.announcement is not None
        if not self.client.receive(message):
            return
        announcement = self.announcement
        masked = self.client.mask(announcement, self.delta(self.shared), self.samples, 0.1, None)
        vector = self.masked(masked[MASKED_TENSOR].numpy().view(np.uint32).copy())
        if vector is None:
            return
        masked_update = {MASKED_TENSOR: torch.from_numpy(vector.view(np.int32))}
        update = update_frame(announcement, LIAR, masked_update)
        self.transport.publish(topics.device(FLEET, LIAR, "update"), update)


@dataclass
class Fleet:
    """The engine, its honest agents, the liar, and what the engine waited for."""

    coordinator: Coordinator
    broker: InProcessBroker
    honest: list[str]
    unmaskings: list[int] = field(default_factory=list)
    waits: list[tuple[float, bool]] = field(default_factory=list)
    """Each wait's timeout and whether it ended before it."""

    @property
    def settled(self) -> list[bool]:
        """Each wait of the coordinator: True when it ended because the awaited thing happened."""
        return [done for _, done in self.waits]


def fleet(liar: Liar | None, honest: int = 3, **options: Any) -> Fleet:
    """`honest` agents and the liar (joined) around a secure engine; `options`: the run's."""
    broker = InProcessBroker()
    settings = SimulationSettings.load(
        None, task=TASK, algorithm="fedavg", devices=honest, secagg=True, **options
    )
    coordinator = hub_engine(
        broker,
        settings,
        EngineSettings(task=TASK, rounds=5, quorum=0.5, round_timeout_s=5.0, seed=1),
        privacy=privacy_engine(settings.privacy(), settings.participation, 0),
    )
    result = Fleet(coordinator, broker, [f"dev-{index}" for index in range(honest)])
    record_waits(coordinator, result.waits)
    coordinator.start()
    members = honest
    if liar is not None:  # first: its answers come before the honest devices'
        liar.start(broker.connect(LIAR, device_will(FLEET, LIAR)), _copy(coordinator.shared))
        members += 1
    hub_agents(broker, result.honest)
    watcher = broker.connect("watcher")
    watcher.subscribe(
        topics.secure(FLEET),
        lambda _, payload: (
            result.unmaskings.append(coordinator.round_id + 1)
            if isinstance(decode_frame(payload)[0], SecAggUnmask)
            else None
        ),
    )
    assert coordinator.wait_for_devices(members, 2.0)
    result.waits.clear()
    return result


def _copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in tensors.items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a))


def garbage(vector: np.ndarray) -> np.ndarray:
    """Half the ring added to every entry: a sum out of range, whatever the masks and updates.

    (Uniformly random words are out of range too in all but a vanishing share of draws; a sum
    that lands in range is a bounded liar's, see docs/security.md.)
    """
    shifted: np.ndarray = vector + np.uint32(2**30)
    return shifted


# -- a garbage masked vector ------------------------------------------------------------------


def test_a_garbage_masked_vector_skips_the_round_after_one_unmasking_and_the_run_goes_on() -> None:
    run = fleet(Liar(masked=garbage))
    before = _copy(run.coordinator.shared)
    records = [run.coordinator.run_round() for _ in range(2)]
    assert [r.round_id for r in records] == [1, 2]
    assert all(r.scalars["secagg_skipped"] == 1 for r in records)
    assert all(r.scalars["secagg_survivors"] == 4 for r in records)  # the honest three answered
    assert run.unmaskings == [1, 2]  # one unmasking a round: the refused sum is not redone
    assert _distance(run.coordinator.shared, before) == 0
    assert all(r.bytes_up > 0 and r.bytes_down > 0 for r in records)  # what it cost is counted
    assert run.coordinator.offences.count(run.honest[0]) == 0


def test_a_refused_sum_under_dp_is_accounted_once_and_never_unmasked_again() -> None:
    run = fleet(Liar(masked=garbage), dp_noise=1.0, dp_sampling="fixed", dp_placement="device")
    record = run.coordinator.run_round()
    privacy = privacy_of(run.coordinator)
    assert privacy is not None
    assert record.scalars["secagg_skipped"] == 1
    assert run.unmaskings == [1]
    # the sum the coordinator saw is counted once, with the noise of the 4 devices in it
    (counted,) = privacy.accountant.rounds
    assert (counted.noise_multiplier, counted.population, counted.cohort) == (1.0, 4, 4.0)
    assert record.scalars["dp_epsilon"] == privacy.epsilon > 0


# -- shares that rebuild another seed ---------------------------------------------------------


def swap_seed(liar: Liar) -> None:
    """Commit to one seed, deal shares of another: the rebuilt seed names the dealer."""
    assert liar.client is not None
    assert liar.client._round is not None
    liar.client._round.seed = secrets.token_bytes(32)


def test_a_dealer_of_false_shares_is_named_quarantined_and_left_out_of_the_retry() -> None:
    run = fleet(Liar(after_keys=swap_seed))
    record = run.coordinator.run_round()
    assert "secagg_skipped" not in record.scalars
    assert record.participants == 3
    assert record.scalars["secagg_survivors"] == 3
    assert run.coordinator.quarantine.held() == {LIAR}
    assert run.coordinator.offences.count(LIAR) >= 1
    second = run.coordinator.run_round()  # named again, left out again: the run goes on
    assert second.participants == 3


# -- a huge declared data set -----------------------------------------------------------------


def full_clip(shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A delta of norm CLIP: the most a device may send."""
    size = sum(value.numel() for value in shared.values())
    return {name: torch.full_like(value, CLIP / math.sqrt(size)) for name, value in shared.items()}


def test_a_huge_declared_count_is_capped_to_half_of_the_cohort_under_secure_aggregation() -> None:
    liar = Liar(samples=10**8, delta=full_clip)
    run = fleet(liar)
    before = _copy(run.coordinator.shared)
    record = run.coordinator.run_round()
    assert record.participants == 4
    assert liar.announcement is not None
    assert liar.announcement.secure is not None
    honest = sum(
        run.coordinator.registry.declared_samples(device_id) or 0 for device_id in run.honest
    )
    # water-filling over the declared counts: the liar weighs what the other three together do
    assert liar.announcement.secure.weight_bound == honest
    moved = _distance(run.coordinator.shared, before)
    honest_run = fleet(None)
    honest_run.coordinator.run_round()
    honest_moved = _distance(honest_run.coordinator.shared, before)
    assert moved <= 0.5 * CLIP + honest_moved  # at most half the round's weight, clipped


# -- dropouts that end a phase early ---------------------------------------------------------


def decline_after_keys(liar: Liar) -> None:
    """Send keys, then say "skipped" (its training failed): no phase may wait for it."""
    assert liar.announcement is not None
    status = DeviceStatus(
        device_id=LIAR,
        state="skipped",
        round_id=liar.announcement.round_id,
        run_id=liar.announcement.run_id,
    )
    liar.transport.publish(topics.device(FLEET, LIAR, "status"), encode_frame(status))
    liar.client = SecureClient(LIAR, lambda message: None)  # and it says nothing more


def vanish_after_keys(liar: Liar) -> None:
    """Send keys, then lose the connection: the broker publishes its will."""
    liar.transport.vanish()


def test_a_device_that_declines_after_its_keys_costs_no_phase_its_deadline() -> None:
    run = fleet(Liar(after_keys=decline_after_keys))
    record = run.coordinator.run_round()
    assert record.participants == 3
    assert run.settled
    assert all(run.settled)


def test_a_device_that_drops_out_after_its_keys_costs_no_phase_its_deadline() -> None:
    liar = Liar(after_keys=vanish_after_keys)
    run = fleet(liar)
    record = run.coordinator.run_round()
    assert record.participants == 3
    assert run.settled
    assert all(run.settled)
    assert LIAR not in run.coordinator.registry.online_ids()


# -- too few drawn under DP -------------------------------------------------------------------


def test_a_poisson_draw_of_too_few_devices_is_skipped_and_counted_not_drawn_again() -> None:
    run = fleet(None, honest=5, dp_noise=1.0, participation=0.4)
    records = [run.coordinator.run_round() for _ in range(8)]
    privacy = privacy_of(run.coordinator)
    assert privacy is not None
    skipped = [r for r in records if r.scalars.get("secagg_skipped")]
    assert skipped
    assert len(skipped) < len(records)
    assert all(r.selected < 3 and r.participants == 0 for r in skipped)
    assert len(privacy.accountant.rounds) == len(records)  # every round drawn is accounted
    assert [r.round_id for r in records] == list(range(1, 9))


# -- a failure before any unmasking -----------------------------------------------------------


def test_a_round_that_fails_before_unmasking_is_retried_then_skipped_releasing_nothing() -> None:
    # two honest devices and one that deals but never sends its masked update: 2 survivors of
    # the 3 a sum needs, every attempt
    run = fleet(Liar(masked=lambda vector: None), honest=2, dp_noise=1.0, dp_sampling="fixed")
    record = run.coordinator.run_round()
    privacy = privacy_of(run.coordinator)
    assert privacy is not None
    assert record.scalars["secagg_skipped"] == 1
    assert record.scalars["secagg_attempts"] == 3  # the first and the 2 retries
    assert record.scalars["secagg_survivors"] == 0
    assert run.unmaskings == []  # no sum was ever unmasked
    assert len(privacy.accountant.rounds) == 1  # the round drawn, counted once
    assert run.coordinator.run_round().round_id == 2  # and the run goes on


def test_a_device_silent_after_its_keys_costs_one_deadline_then_only_a_grace() -> None:
    run = fleet(Liar(silent=True))
    deadline = SecureAggregationSettings().phase_timeout_s
    first = run.coordinator.run_round()
    assert (deadline, False) in run.waits  # its shares phase ran out once
    run.waits.clear()
    second = run.coordinator.run_round()
    assert (first.participants, second.participants) == (3, 3)
    assert (deadline, False) not in run.waits  # not again: no short phase waits its deadline
    assert (deadline * GRACE_SHARE, False) in run.waits  # only the grace, once others were in


def test_a_device_connected_and_silent_through_a_phase_is_a_straggler_of_each_round() -> None:
    run = fleet(Liar(silent=True))
    for _ in range(2):  # its deadline, then only a grace: a straggler of each round
        run.coordinator.run_round()
    status = run.coordinator.last_fleet_status
    assert status is not None
    devices = {d.device_id: d for d in status.devices}
    assert (devices[LIAR].missed_deadlines, devices[LIAR].missed_round) == (2, 2)
    assert all(devices[d].missed_deadlines == 0 for d in run.honest)


def test_a_device_that_declines_or_drops_out_inside_a_secure_round_is_no_straggler() -> None:
    for after_keys in (decline_after_keys, vanish_after_keys):
        run = fleet(Liar(after_keys=after_keys))
        run.coordinator.run_round()
        status = run.coordinator.last_fleet_status
        assert status is not None
        assert all(d.missed_deadlines == 0 for d in status.devices), after_keys
