"""Faults mid-round leave the result exactly what the surviving devices' updates determine."""

import dataclasses

import torch

from coordinator.engine.rounds import EngineSettings
from coordinator.run.settings import SimulationSettings
from device_agent.agent import DeviceAgent
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols.transport.inprocess import InProcessBroker, InProcessTransport
from tests.hub_fleet import hub_agent, hub_engine

DEVICES = 10
FAILING = ("dev-02", "dev-05", "dev-08")  # 30% of the fleet


def _run(failure: str) -> dict[str, torch.Tensor]:
    """Four FedAvg rounds; from round 2 on the FAILING devices crash or decline mid-round."""
    settings = SimulationSettings.load(None, task="digits", algorithm="fedavg", devices=DEVICES)
    task = load_task("digits")
    broker = InProcessBroker()
    coordinator = hub_engine(broker, settings, EngineSettings(task="digits", rounds=4, quorum=0.5))
    fleet = task.make_fleet(DEVICES, PartitionSpec(), 0)
    for index, data in enumerate(fleet):
        device_id = f"dev-{index:02d}"
        agent = hub_agent(broker, device_id, task, data)
        if device_id in FAILING:
            agent._train = _failing(agent, failure)  # type: ignore[method-assign]
        agent.start()
    coordinator.start()
    coordinator.wait_for_devices(DEVICES, 1.0)
    participants = [coordinator.run_round().participants for _ in range(4)]
    assert participants == [10, 7, 7, 7]
    return coordinator.shared


def _failing(agent: DeviceAgent, failure: str):
    original = agent._train

    def train(announcement, model, peer_models=None) -> None:
        if announcement.round_id < 2:
            original(announcement, model, peer_models)
        elif failure == "crash":  # trained or not, the process is gone: only its will remains
            assert isinstance(agent.transport, InProcessTransport)
            agent.transport.vanish()
        else:
            agent.publish_status(
                "skipped",
                round_id=announcement.round_id,
                run_id=announcement.run_id,
                detail="declined",
            )

    return train


def test_devices_crashing_mid_round_give_the_model_of_a_fault_free_run_without_them() -> None:
    # Execute: 30% of devices crash in round 2 (last-will "offline", never answer) against a
    # fault-free run where the same devices answer round 1 and then decline every round
    crashed = _run("crash")
    declined = _run("decline")
    # Assert: FedAvg is deterministic given the participants, so the models are identical
    for name, tensor in crashed.items():
        assert torch.equal(tensor, declined[name]), name


def test_a_device_whose_model_scores_inf_declines_the_evaluation_clearly() -> None:
    # Prepare: three devices; one's test targets overflow float32, so its test MSE is inf
    from pfl_tasks.base import Split

    task = load_task("sine")
    broker = InProcessBroker()
    settings = SimulationSettings.load(None, task="sine", algorithm="fedavg", devices=3)
    coordinator = hub_engine(
        broker, settings, EngineSettings(task="sine", rounds=1, round_timeout_s=30.0)
    )
    statuses = []
    broker.connect("tap").subscribe("pfl/+/device/+/status", lambda _t, p: statuses.append(p))
    fleet = task.make_fleet(3, PartitionSpec(), 0)
    broken = fleet[1].test
    fleet[1] = dataclasses.replace(
        fleet[1], test=Split(broken.inputs, torch.full_like(broken.targets, 3e38))
    )
    for index, data in enumerate(fleet):
        hub_agent(broker, f"dev-{index:02d}", task, data).start()
    coordinator.start()
    coordinator.wait_for_devices(3, 1.0)
    coordinator.run_round()
    # Execute
    reports, summary = coordinator.evaluate(final=True)
    # Assert: the two others report; the broken one says why instead of vanishing
    assert [r.device_id for r in reports] == ["dev-00", "dev-02"]
    assert summary["personalized_mean"] is not None
    from protocols.codec import decode_frame

    skipped = [decode_frame(p)[0] for p in statuses]
    assert any(
        s.device_id == "dev-01" and s.state == "skipped" and "is inf" in s.detail  # type: ignore[union-attr]
        for s in skipped
    )
