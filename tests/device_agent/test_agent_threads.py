"""A real device agent trains on the threads its model's work per step is worth."""

from __future__ import annotations

import pytest
import torch

from device_agent.agent import DeviceAgent
from device_agent.compute_threads import StepThreads, torch_threads
from pfl_tasks.registry import load_task
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import TASK, hub_agents, hub_coordinator


def _threads_while_training(agent: DeviceAgent) -> list[int]:
    seen: list[int] = []
    agent.workspace.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    return seen


@pytest.mark.parametrize("chooses", [True, False])
def test_a_small_model_trains_on_one_thread_and_the_process_setting_comes_back(
    chooses: bool,
) -> None:
    # Prepare: torch on two threads, as on a 2-core device; digits' MLP is far below one
    # thread's worth of work per step
    task = load_task(TASK)
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", 1, 1)
    choice = StepThreads(task.build_model(0), [torch.zeros(1, 64)], cores=2) if chooses else None
    (agent,) = hub_agents(broker, ["dev-a"], lambda index: {"threads": choice})
    seen = _threads_while_training(agent)
    with torch_threads(2):
        # Execute: one round
        coordinator.start()
        assert coordinator.wait_for_devices(1, 1.0)
        record = coordinator.run_round()
        broker.pump(lambda: False)
        after = torch.get_num_threads()
    # Assert: trained on one thread when the agent chooses, else on the process's two
    assert record.participants == 1
    assert seen
    assert set(seen) == ({1} if chooses else {2})
    assert after == 2
