"""Devices download a model only for work they are asked to do, and never one they hold."""

from __future__ import annotations

import pytest

from coordinator.engine.rounds import Coordinator
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.agent import DeviceAgent
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import Command, ExportArguments, RoundAnnouncement, SharedModel
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents, hub_coordinator
from tests.wiretap import Wiretap

DEVICES = 10
MODEL = topics.shared_model("default")
DELTA = topics.model_delta("default")


def _fleet(
    participation: float, **run: object
) -> tuple[InProcessBroker, Coordinator, list[DeviceAgent], list[Wiretap]]:
    broker = InProcessBroker()
    coordinator = hub_coordinator(
        broker, "fedavg", DEVICES, 4, run={"participation": participation, "seed": 1, **run}
    )
    taps = [Wiretap(broker.connect(f"dev-{i}")) for i in range(DEVICES)]
    coordinator.start()
    agents = hub_agents(broker, [t.client_id for t in taps], lambda i: {"transport": taps[i]})
    assert coordinator.wait_for_devices(DEVICES, 5.0)
    return broker, coordinator, agents, taps


def _addressed(coordinator: Coordinator) -> set[str]:
    assert coordinator._announcement is not None
    announcement, _ = decode_frame(coordinator._announcement)
    assert isinstance(announcement, RoundAnnouncement)
    return set(announcement.selected) or {f"dev-{i}" for i in range(DEVICES)}


def test_only_selected_devices_download_the_model() -> None:
    _, coordinator, _, taps = _fleet(participation=0.3)
    model_bytes = len(coordinator.models._frames[MODEL])  # every round's model has this size
    for _ in range(3):
        marks = [len(tap.log) for tap in taps]
        record = coordinator.run_round()
        selected = _addressed(coordinator)
        assert len(selected) == 3
        for tap, mark in zip(taps, marks, strict=True):
            received = tap.log[mark:]
            got_model = [size for topic, size in received if topic == MODEL]
            if tap.client_id in selected:
                assert len(got_model) == 1, tap.client_id
                assert abs(got_model[0] - model_bytes) < 64  # the header's send time varies
            else:  # the announcement and the fleet status, never a model byte
                assert got_model == [], tap.client_id
                assert sum(size for _, size in received) < model_bytes / 4
        # the coordinator's count: p x devices x model, plus one announcement per device
        announcement = len(coordinator._announcement or b"")
        assert record.bytes_down <= 1.05 * 3 * model_bytes + DEVICES * announcement


def test_a_device_holding_the_current_model_does_not_fetch_it_again() -> None:
    _, coordinator, _, taps = _fleet(participation=0.3)
    coordinator.run_round()
    coordinator.evaluate()  # every device fetches the new model to evaluate it
    marks = [len(tap.log) for tap in taps]
    before = coordinator.bytes_down
    coordinator.evaluate()  # same model: nobody downloads anything
    assert all(MODEL not in tap.topics_since(mark) for tap, mark in zip(taps, marks, strict=True))
    assert coordinator.bytes_down - before == DEVICES * len(coordinator._announcement or b"")


def test_a_device_not_selected_lately_fetches_the_model_before_it_exports(tmp_path) -> None:
    broker, coordinator, agents, taps = _fleet(participation=0.3)
    coordinator.run_round()
    coordinator.run_round()
    left_out = next(a for a in agents if a.device_id not in _addressed(coordinator))
    assert (
        left_out._model is None or left_out._model.header.manifest.sha256 != coordinator.models.sha
    )
    operator = broker.connect("pfl-operator")
    reports: list[bytes] = []
    operator.subscribe(
        topics.device("default", left_out.device_id, "export-report"),
        lambda _, p: reports.append(p),
    )
    command = Command(action="export", export=ExportArguments(out_dir=str(tmp_path)))
    operator.publish(topics.command("default", left_out.device_id), encode_frame(command))
    assert operator.wait_until(lambda: bool(reports), 30.0)
    report, _ = decode_frame(reports[0])
    assert report.ok, report.error  # type: ignore[union-attr]
    assert left_out._model is not None
    assert left_out._model.header.manifest.sha256 == coordinator.models.sha
    del taps


def test_int8_downlink_sends_deltas_to_devices_holding_the_previous_model() -> None:
    _, coordinator, agents, taps = _fleet(participation=1.0, compress_down="int8")
    coordinator.run_round()  # first round: everybody fetches the whole model
    marks = [len(tap.log) for tap in taps]
    coordinator.run_round()  # everybody holds the first model: the delta to the second suffices
    announced, _ = decode_frame(coordinator._announcement or b"")
    assert isinstance(announced, RoundAnnouncement)
    sizes = {}
    for tap, mark in zip(taps, marks, strict=True):
        got = [(topic, size) for topic, size in tap.log[mark:] if topic in (MODEL, DELTA)]
        assert [topic for topic, _ in got] == [DELTA], tap.client_id
        sizes[DELTA] = got[0][1]
    whole = coordinator.models._frames[MODEL]
    assert sizes[DELTA] <= 0.3 * len(whole)
    for agent in agents:  # rebuilt from the delta, bit for bit the model the coordinator published
        assert agent._model is not None
        assert agent._model.header.manifest.sha256 == announced.model_sha256
    coordinator.evaluate()  # and the personalized evaluation runs on it
    # the coordinator's own model is the aggregate; what it published differs by the int8 step
    published, exact = coordinator.models.published, coordinator.model
    assert any(not (published[n] == exact[n]).all() for n in exact)


@pytest.mark.mosquitto
def test_over_mosquitto_devices_receive_only_the_models_they_work_on(mosquitto) -> None:
    rounds, devices = 4, 8
    settings = SimulationSettings.load(
        None,
        task="digits",
        algorithm="fedavg",
        devices=devices,
        rounds=rounds,
        participation=0.25,
        transport="mqtt",
        broker=mosquitto.url,
    )
    result = run_simulation(settings)
    manifest, blob = pack_tensors(load_task("digits").build_model(0).state_dict())
    model = len(encode_frame(SharedModel(round_id=1, manifest=manifest), blob))
    received = sum(a.transport.stats.wire_bytes_received for a in result.agents)  # type: ignore[attr-defined]
    # 2 of 8 devices download in each round, all 8 for the final evaluation: 16 models, where a
    # broadcast would deliver (rounds + 1) x 8 = 40; the rest is announcements and statuses
    assert 16 * model <= received <= 1.05 * 16 * model + rounds * devices * 3000
