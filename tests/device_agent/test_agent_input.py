import pytest
import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import encode_frame, pack_tensors
from protocols.errors import ProtocolError
from protocols.messages import SharedModel
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agent, hub_agents, hub_coordinator


def test_a_corrupt_model_is_dropped_and_the_previous_one_still_trains() -> None:
    # Prepare: a fleet of one, and a forger on the hub
    settings = SimulationSettings.load(None, task="digits", algorithm="fedavg", devices=1, rounds=2)
    task = load_task("digits")
    model = task.build_model(0)
    broker = InProcessBroker()
    coordinator = build_coordinator(
        lambda: broker.connect("coordinator"),
        plan_stages(settings, task, model),
        model,
        EngineSettings(task="digits", rounds=2),
    )
    agent = hub_agent(broker, "dev-0", task, task.make_fleet(2, PartitionSpec(), 0)[0], will=False)
    agent.start()
    coordinator.start()
    coordinator.wait_for_devices(1, 1.0)
    coordinator.run_round()
    good = agent._model  # the model round 1 trained on
    assert good is not None
    assert good.header.round_id == 0
    manifest, blob = pack_tensors({k: v + 1 for k, v in model.state_dict().items()})
    corrupt = bytearray(blob)
    corrupt[-1] ^= 0xFF  # the checksum no longer matches
    # Execute: the corrupt frame reaches the agent's model handler, as a delivery would
    with pytest.raises(ProtocolError, match="checksum"):
        agent._on_model(
            topics.shared_model("default"),
            encode_frame(SharedModel(round_id=9, manifest=manifest), bytes(corrupt)),
        )
    # Assert: the agent kept the good model, and the next round completes with the new one
    assert agent._model is good
    record = coordinator.run_round()
    assert record.participants == 1
    assert agent._model.header.round_id == 1
    assert all(torch.isfinite(t).all() for t in coordinator.shared.values())


def test_a_new_run_never_gets_an_earlier_runs_cached_answer() -> None:
    # Prepare: one agent, and a coordinator whose round 1 it answers
    broker = InProcessBroker()
    hub_agents(broker, ["dev-0"])

    def coordinator_run() -> Coordinator:
        return hub_coordinator(broker, "fedavg", 1, 1)

    first = coordinator_run()
    first.start()
    assert first.wait_for_devices(1, 1.0)
    assert first.run_round().participants == 1
    first.transport.close()
    # Execute: a fresh run asks for the same round of the same model (same seed, same digest)
    second = coordinator_run()
    second.start()
    assert second.wait_for_devices(1, 1.0)
    record = second.run_round()
    # Assert: the agent worked for the new run instead of re-sending run 1's answer
    assert second.run_id != first.run_id
    assert second.models.sha == first.models.sha
    assert record.participants == 1
    assert second.rejected == 0
