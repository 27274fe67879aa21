"""Fuzzing: malformed messages thrown at a coordinator and device agents mid-run change nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.settings import SimulationSettings
from device_agent.agent import DeviceAgent
from device_agent.state_store import MemoryStateStore
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.errors import PflError
from protocols.messages import (
    Command,
    DeviceUpdate,
    EvaluationReport,
    RoundAnnouncement,
    SharedModel,
)
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_engine

FLEET = "default"
DEVICES = ("dev-0", "dev-1", "dev-2")
ROUNDS = 3
TASK = "sine"
RUN = "f" * 32  # the fleet's coordinator runs under this id, so crafted answers reach it
STALE_ROUND = 777_777  # never current; no 1-3 bit flips of its digits reach a real round id
FUZZ_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HANDLER_SETTINGS = settings(max_examples=1500, deadline=None, database=None)


@dataclass
class Fleet:
    """A coordinator and real device agents wired through one in-process hub."""

    broker: InProcessBroker
    coordinator: Coordinator
    agents: list[DeviceAgent]
    round_id: int = 0
    specs: dict[str, torch.Tensor] = field(default_factory=dict)


def _fleet() -> Fleet:
    simulation = SimulationSettings.load(
        None, task=TASK, algorithm="fedavg", devices=len(DEVICES), rounds=ROUNDS
    )
    task = load_task(TASK)
    broker = InProcessBroker()
    coordinator = hub_engine(broker, simulation, EngineSettings(task=TASK, rounds=ROUNDS))
    coordinator.run_id = RUN
    shards = task.make_fleet(len(DEVICES), PartitionSpec(), 0)
    agents = []
    for index, device_id in enumerate(DEVICES):
        workspace = task.build_model(0)
        agents.append(
            DeviceAgent(
                device_id=device_id,
                fleet=FLEET,
                transport=broker.connect(device_id),
                task=task,
                data=shards[index],
                seed=0,
                store=MemoryStateStore(),
                workspace=workspace,
                initial_state={k: v.clone() for k, v in workspace.state_dict().items()},
            )
        )
    return Fleet(broker, coordinator, agents, specs=dict(coordinator.shared))


def _run(
    fleet: Fleet, before_round: Callable[[int], None] | None = None
) -> dict[str, torch.Tensor]:
    for agent in fleet.agents:
        agent.start()
    fleet.coordinator.start()
    assert fleet.coordinator.wait_for_devices(len(DEVICES), 1.0)
    for round_id in range(1, ROUNDS + 1):
        if before_round is not None:
            before_round(round_id)
        fleet.coordinator.run_round()
    fleet.coordinator.evaluate(final=True)
    return {name: value.clone() for name, value in fleet.coordinator.model.items()}


_clean: dict[str, torch.Tensor] = {}


def clean_model() -> dict[str, torch.Tensor]:
    """The final model of an undisturbed run, computed once."""
    if not _clean:
        _clean.update(_run(_fleet()))
    return _clean


# -- malformed messages -----------------------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    """A payload for a topic, and whose handler must reject it."""

    topic: str
    payload: bytes
    target: str  # "coordinator" or "agent"


def _update(round_id: int, device_id: str, tensors: dict[str, torch.Tensor], **extra: Any) -> bytes:
    manifest, blob = pack_tensors(tensors)
    fields: dict[str, Any] = {"algorithm": "fedavg", "num_samples": 10, "train_loss": 0.5, **extra}
    header = DeviceUpdate(
        run_id=RUN, round_id=round_id, device_id=device_id, manifest=manifest, sent_at=0.0, **fields
    )
    return encode_frame(header, blob)


def _zeros(specs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(value) for name, value in specs.items()}


def _valid_frames(specs: dict[str, torch.Tensor]) -> list[bytes]:
    """Well-formed frames that nothing may accept: their round is stale (bit-flip material)."""
    report = EvaluationReport(
        run_id=RUN,
        round_id=STALE_ROUND,
        device_id="dev-1",
        metric_name="mse",
        personalized=0.1,
        num_test_samples=1,
        num_train_samples=1,
        sent_at=0.0,
    )
    return [_update(STALE_ROUND, "dev-1", _zeros(specs)), encode_frame(report)]


def _agent_frames(specs: dict[str, torch.Tensor]) -> list[bytes]:
    """Frames an agent receives on its topics, for truncation and corrupt prefixes."""
    manifest, blob = pack_tensors(_zeros(specs))
    announcement = RoundAnnouncement(
        run_id=RUN,
        round_id=1,
        phase="train",
        algorithm="fedavg",
        model_sha256=manifest.sha256,
        sent_at=0.0,
    )
    return [
        encode_frame(SharedModel(round_id=1, manifest=manifest, sent_at=0.0), blob),
        encode_frame(announcement),
        encode_frame(Command(action="hello", sent_at=0.0)),
    ]


@st.composite
def malformed(draw: st.DrawFn, specs: dict[str, torch.Tensor], round_id: int) -> Malformed:
    """One message its receiver must reject, of a kind chosen by hypothesis."""
    device = draw(st.sampled_from(DEVICES))
    kind = draw(st.sampled_from(["hello", "status", "update", "evaluation"]))
    to_coordinator = topics.device(FLEET, device, kind)
    agent_topic = draw(
        st.sampled_from(
            [
                topics.shared_model(FLEET),
                topics.round_announcement(FLEET),
                topics.command(FLEET),
                topics.command(FLEET, device),
            ]
        )
    )
    choice = draw(st.integers(0, 9))
    if choice == 0:  # random bytes, anywhere
        payload = draw(st.binary(max_size=512))
        target = draw(st.sampled_from(["coordinator", "agent"]))
        return Malformed(
            to_coordinator if target == "coordinator" else agent_topic, payload, target
        )
    if choice == 1:  # a valid-looking prefix with garbage after it
        tail = draw(st.binary(max_size=256))
        return Malformed(
            to_coordinator, b"PFL\x01" + len(tail).to_bytes(4, "big") + tail, "coordinator"
        )
    if choice == 2:  # truncated or over-long frames
        frames = _valid_frames(specs) + _agent_frames(specs)
        frame = draw(st.sampled_from(frames))
        if draw(st.booleans()):
            payload = frame[: draw(st.integers(0, len(frame) - 1))]
        else:
            payload = frame + draw(st.binary(min_size=1, max_size=4096))
        target = draw(st.sampled_from(["coordinator", "agent"]))
        return Malformed(
            to_coordinator if target == "coordinator" else agent_topic, payload, target
        )
    if choice == 3:  # bit flips anywhere in a stale update or evaluation report
        flipped = bytearray(draw(st.sampled_from(_valid_frames(specs))))
        for _ in range(draw(st.integers(1, 3))):
            bit = draw(st.integers(0, len(flipped) * 8 - 1))
            flipped[bit // 8] ^= 1 << (bit % 8)
        return Malformed(to_coordinator, bytes(flipped), "coordinator")
    if choice == 4:  # bit flips in the magic or header length of an agent's frames
        flipped = bytearray(draw(st.sampled_from(_agent_frames(specs))))
        bit = draw(st.integers(0, 8 * 8 - 1))
        flipped[bit // 8] ^= 1 << (bit % 8)
        return Malformed(agent_topic, bytes(flipped), "agent")
    if choice == 5:  # the current round's update with a wrong manifest
        name = draw(st.sampled_from(sorted(specs)))
        wrong = _zeros(specs)
        mutation = draw(st.sampled_from(["shape", "dtype", "missing", "extra"]))
        if mutation == "shape":
            wrong[name] = torch.zeros(wrong[name].numel() + draw(st.integers(1, 1000)))
        elif mutation == "dtype":
            wrong[name] = wrong[name].to(torch.float64)
        elif mutation == "missing":
            del wrong[name]
        else:
            wrong["extra.weight"] = torch.zeros(draw(st.integers(0, 64)))
        return Malformed(
            topics.device(FLEET, device, "update"), _update(round_id, device, wrong), "coordinator"
        )
    if choice == 6:  # the current round's update on another device's topic
        other = draw(st.sampled_from([d for d in DEVICES if d != device]))
        topic = topics.device(FLEET, other, "update")
        return Malformed(topic, _update(round_id, device, _zeros(specs)), "coordinator")
    if choice == 7:  # stale and far-future rounds
        stale = draw(st.sampled_from([round_id - 1, STALE_ROUND, 2**31]))
        topic = topics.device(FLEET, device, "update")
        return Malformed(topic, _update(stale, device, _zeros(specs)), "coordinator")
    if choice == 8:  # unknown kinds and wrong kinds
        header = draw(
            st.sampled_from(
                [
                    b'{"kind":"teleport","protocol_version":1}',
                    b'{"kind":"update"}',
                    b"[]",
                    b'{"kind":"hello","protocol_version":999}',
                ]
            )
        )
        if draw(st.booleans()):
            payload = b"PFL\x01" + len(header).to_bytes(4, "big") + header
            target = draw(st.sampled_from(["coordinator", "agent"]))
            return Malformed(
                to_coordinator if target == "coordinator" else agent_topic, payload, target
            )
        return Malformed(
            to_coordinator, encode_frame(Command(action="shutdown", sent_at=0.0)), "coordinator"
        )
    # choice 9: a message for the coordinator sent to agents, or a command sent to the coordinator
    update = _update(STALE_ROUND, device, _zeros(specs))
    if draw(st.booleans()):
        return Malformed(agent_topic, update, "agent")
    return Malformed(
        topics.device(FLEET, device, "update"),
        encode_frame(Command(action="hello", sent_at=0.0)),
        "coordinator",
    )


# -- the properties ---------------------------------------------------------------------------


def _hub_failures(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "protocols.transport.inprocess" and r.exc_info]


@FUZZ_SETTINGS
@given(data=st.data())
def test_malformed_messages_during_a_run_change_nothing(data: st.DataObject) -> None:
    fleet = _fleet()
    fuzzer = fleet.broker.connect("fuzzer")
    sent: list[Malformed] = []
    records: list[logging.LogRecord] = []
    handler = _ListHandler(records)
    hub_logger = logging.getLogger("protocols.transport.inprocess")
    hub_logger.addHandler(handler)
    hub_logger.setLevel(logging.DEBUG)  # the traceback of each failure is a debug record

    during: dict[int, list[Malformed]] = {}

    def inject(round_id: int) -> None:
        # Half before the round opens, half right behind the devices' answers to its announcement
        before = data.draw(st.lists(malformed(fleet.specs, round_id), min_size=10, max_size=30))
        during[round_id] = data.draw(
            st.lists(malformed(fleet.specs, round_id), min_size=10, max_size=30)
        )
        for message in before:
            fuzzer.publish(message.topic, message.payload)
        sent.extend(before)

    def on_round(_topic: str, payload: bytes) -> None:
        try:  # the fuzzer's own garbage arrives here too
            announcement, _ = decode_frame(payload)
        except PflError:
            return
        if isinstance(announcement, RoundAnnouncement) and announcement.phase == "train":
            for message in during.pop(announcement.round_id, []):
                fuzzer.publish(message.topic, message.payload)
                sent.append(message)

    fuzzer.subscribe(topics.round_announcement(FLEET), on_round)
    try:
        final = _run(fleet, inject)
    finally:
        hub_logger.removeHandler(handler)
        hub_logger.setLevel(logging.NOTSET)
    # Assert: no unexpected exception; every coordinator-bound message rejected and counted
    failures = _hub_failures(records)
    unexpected = [r for r in failures if not issubclass(r.exc_info[0], PflError)]  # type: ignore[index, arg-type]
    assert not unexpected, unexpected[0].exc_info
    assert fleet.coordinator.rejected == sum(m.target == "coordinator" for m in sent)
    agent_rejections = sum(
        sum(
            topics.topic_matches(pattern, m.topic)
            for a in fleet.agents
            for pattern in _agent_topics(a)
        )
        for m in sent
        if m.target == "agent"
    )
    # an agent reads the model topic only while it fetches a model: those may or may not arrive
    on_model_topic = len(fleet.agents) * sum(
        m.topic == topics.shared_model(FLEET) for m in sent if m.target == "agent"
    )
    assert agent_rejections <= len(failures) <= agent_rejections + on_model_topic
    # Assert: the run ended exactly where an undisturbed one does (and it did train)
    assert not during
    initial = load_task(TASK).build_model(0).state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in final.items())
    for name, value in clean_model().items():
        assert torch.equal(final[name], value), name


def _agent_topics(agent: DeviceAgent) -> list[str]:
    """The topics an agent always reads (the model topic only while it fetches one)."""
    return [
        topics.round_announcement(FLEET),
        topics.command(FLEET),
        topics.command(FLEET, agent.device_id),
    ]


class _ListHandler(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def idle_fleet() -> Fleet:
    """A fleet that has run one round and has the second one's updates outstanding."""
    fleet = _fleet()
    _run_setup(fleet)
    return fleet


def _run_setup(fleet: Fleet) -> None:
    for agent in fleet.agents:
        agent.start()
    fleet.coordinator.start()
    fleet.coordinator.wait_for_devices(len(DEVICES), 1.0)
    fleet.coordinator.run_round()


@HANDLER_SETTINGS
@given(data=st.data())
def test_handlers_reject_malformed_messages_with_protocol_errors(
    idle_fleet: Fleet, data: st.DataObject
) -> None:
    # Execute: call the handlers directly, as a transport's dispatch thread would
    fleet = idle_fleet
    message = data.draw(malformed(fleet.specs, fleet.coordinator.round_id + 1))
    before = fleet.coordinator.rejected
    model_before = fleet.coordinator.model
    if message.target == "coordinator":
        _coordinator_handler(fleet.coordinator, message.topic)(message.topic, message.payload)
        # Assert: rejected and counted, nothing else changed
        assert fleet.coordinator.rejected == before + 1
        assert fleet.coordinator.model is model_before
        return
    agent = fleet.agents[0]
    handler = {
        topics.shared_model(FLEET): agent._on_model,
        topics.round_announcement(FLEET): agent._on_round,
    }.get(message.topic, agent._on_command)
    state = (agent._model, agent._pending, agent.last_announcement)
    with pytest.raises(PflError):
        handler(message.topic, message.payload)
    assert (agent._model, agent._pending, agent.last_announcement) == state


def _coordinator_handler(coordinator: Coordinator, topic: str) -> Callable[[str, bytes], None]:
    kind = topic.rsplit("/", 1)[1]
    assert kind in ("hello", "status", "update", "evaluation")
    return next(h for k, h in coordinator.intake.handlers().items() if k == kind)
