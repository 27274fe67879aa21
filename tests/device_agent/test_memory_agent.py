"""An agent under a tight memory budget plans gradient checkpointing and trains with it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from benchmarks.memory_conv import CLASSES, LENGTH, SignalTask
from coordinator.engine.rounds import EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from device_agent.memory_plan import SAFETY_MARGIN, memory_model
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.models import build_seeded
from pfl_tasks.split import ParamSplit
from protocols.algorithms import AlgorithmConfig
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agent

BATCH = AlgorithmConfig.model_fields["batch_size"].default
"""The batch the hello's plan is made for: the round's batch too, so the two plans agree."""
SAMPLES = 64
SCENARIO = "tests.device_agent.test_memory_agent"
"""This module, as a fresh interpreter imports it from the repository root."""


def _deep_blocks() -> nn.Sequential:
    """Eight blocks whose 256-channel internals dwarf their 4-channel boundaries.

    Several MiB of activations a sample plainly, about one block's checkpointed: the window of
    budgets that fit a batch checkpointed and not plainly is tens of MiB wide.
    """
    parts = [
        nn.Sequential(
            nn.Conv1d(1 if index == 0 else 4, 256, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(256, 256, 1),
            nn.ReLU(),
            nn.Conv1d(256, 4, 1),
        )
        for index in range(8)
    ]
    head = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 10))
    return nn.Sequential(*parts, head)


class _DeepTask(SignalTask):
    def __init__(self) -> None:
        super().__init__("cnn")

    def build_model(self, seed: int) -> nn.Module:
        return build_seeded(seed, _deep_blocks)

    def signals(self, count: int, seed: int = 0) -> Split:
        """Signals twice the benchmark's length, for a window about 50 MB wide.

        The process's memory may drift by several MB between the test's plan and the agent's
        (seen with other processes running beside it): a quarter of the window covers that.
        """
        generator = torch.Generator().manual_seed(seed)
        return Split(
            torch.randn((count, 1, 2 * LENGTH), generator=generator),
            torch.randint(0, CLASSES, (count,), generator=generator),
        )


def test_an_agent_under_a_tight_budget_checkpoints_and_trains_its_round() -> None:
    # Execute: in a fresh interpreter, as an agent starts: a worker that ran other tests first
    # holds a heap whose growth under the probe narrows the window below
    output = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests.device_agent.test_memory_agent import tight_round; tight_round()",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    result = json.loads(output.stdout.strip().splitlines()[-1])
    # Assert: the hello's plan (the round's: same batch, same split) checkpoints, and the
    # round was trained under it
    assert result["window"] > 20 * 2**20, result  # a window wider than the drift
    assert result["checkpointing"], result
    assert result["batch_covered"] >= BATCH, result
    assert result["participants"] == 1, result
    assert result["model_changed"], result


def tight_round() -> None:
    """One round under a budget that fits a batch checkpointed but not plainly; prints JSON.

    Plan as the agent will, with the coordinator built (its probe leaves the process larger),
    then a budget whose room over the process's memory fits a batch checkpointed but not plainly
    (then 2 micro-batches or more): a quarter into that window, so the process's memory and the
    probe may move (a step's overhead moves with the plain probe, so nearer the checkpointed
    end).
    """
    task = _DeepTask()
    data = task.signals(SAMPLES)
    device = DeviceData(device_index=0, train=data, val=data, test=data)
    settings = SimulationSettings.load(
        None,
        task="digits",
        algorithm="fedavg",
        devices=1,
        rounds=1,
        algorithm_options={"batch_size": BATCH, "local_epochs": 1},
    )
    broker = InProcessBroker()
    model = task.build_model(0)
    coordinator = build_coordinator(
        lambda: broker.connect("coordinator"),
        plan_stages(settings, task, model),
        model,
        EngineSettings(task=task.name, rounds=1),
    )
    # planned once the coordinator is built: its allocations are in the agent's runtime too
    probed = task.build_model(0)
    terms = memory_model(probed, task, data, ParamSplit.for_model(probed, ()))
    checkpointed_room = terms.peak(BATCH, checkpointing=True) - terms.runtime_bytes
    plain_room = terms.peak(BATCH) - terms.runtime_bytes
    room = checkpointed_room + (plain_room - checkpointed_room) // 4
    budget = terms.runtime_bytes + math.ceil(room / (1 - SAFETY_MARGIN))
    agent = hub_agent(broker, "dev-0", task, device, memory_budget_bytes=budget)
    before = {k: v.clone() for k, v in coordinator.model.items()}
    agent.start()
    coordinator.start()
    assert coordinator.wait_for_devices(1, 30.0)
    record = coordinator.run_round()
    plan = agent.memory_plan
    after = coordinator.model
    result = {
        "window": plain_room - checkpointed_room,
        "checkpointing": plan is not None and plan.checkpointing,
        "batch_covered": 0 if plan is None else plan.micro_batch_size * plan.accumulation_steps,
        "participants": record.participants,
        "model_changed": any(not torch.equal(after[name], value) for name, value in before.items()),
    }
    sys.stdout.write(json.dumps(result) + "\n")
