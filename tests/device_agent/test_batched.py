"""Batched training of virtual devices: the per-device path's results, family by family.

Tolerance: a stacked step sums its per-sample losses in another order than the per-device mean,
so after 2 rounds every weight, stored personal tensor and reported loss may differ by float32
rounding; they must agree to 1e-5 (absolute, weights) and 1e-5 (relative, losses and metrics).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from device_agent.agent import DeviceAgent
from device_agent.algorithms.base import LocalContext, LocalResult
from device_agent.batched.choice import AUTO_MAX_STEP_MACS, choose_trainer
from device_agent.batched.stacked import model_problem
from device_agent.batched.trainer import Batched
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.registry import load_task
from pfl_tasks.split import ParamSplit
from protocols.algorithms import AlgorithmConfig
from protocols.errors import RoundError
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.process_hub import ProcessHub

pytestmark = pytest.mark.timeout(300)

WEIGHT_TOLERANCE = 1e-5
RELATIVE_TOLERANCE = 1e-5

FAMILIES: dict[str, dict[str, Any]] = {  # what each family's local update needs
    "fedavg": {  # SGD with momentum, weight decay and clipping, two epochs
        "local_epochs": 2,
        "algorithm_options": {"momentum": 0.9, "weight_decay": 1e-3, "clip_grad_norm": 0.5},
    },
    "fedavg-ft": {"algorithm_options": {"max_steps": 3}},
    "fedprox": {"algorithm_options": {"mu": 0.5, "momentum": 0.5}},
    "fedalt": {"personal": ["output.*"], "local_epochs": 2},  # personal stacked, stateful
    "fedsim": {"personal": ["output.*"], "stateless": True},  # stateless, two step sizes
    "local": {},
    "ditto": {  # theta from its stored copy in round 2, pulled toward the received w
        "personal": ["output.*"],
        "algorithm_options": {"momentum": 0.5, "lam": 0.3, "personal_epochs": 2},
    },
}


def _run(algorithm: str, batched: str, **values: Any) -> tuple[SimulationResult, Batched | None]:
    hub = ProcessHub() if values.get("workers", 1) > 1 else InProcessBroker()
    settings = SimulationSettings.load(
        None,
        task="synthetic",
        algorithm=algorithm,
        **{
            "devices": 6,  # the power-law fleet: devices of unequal sizes, so unequal steps
            "rounds": 2,
            "eval_every": 1,
            "seed": 5,
            "workers": 1,
            "batched": batched,
            **values,
        },
    )
    result = run_simulation(settings, broker=hub)
    trainers = [getattr(hook, "__self__", None) for hook in hub.idle]
    return result, next((t for t in trainers if isinstance(t, Batched)), None)


def _max_difference(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    assert one.keys() == other.keys()
    return max((float((one[k] - other[k]).abs().max()) for k in one), default=0.0)


def _assert_same_run(per_device: SimulationResult, batched: SimulationResult) -> None:
    assert _max_difference(per_device.final_shared, batched.final_shared) <= WEIGHT_TOLERANCE
    for one, other in zip(per_device.records, batched.records, strict=True):
        assert one.participants == other.participants
        assert one.train_loss == pytest.approx(other.train_loss, rel=RELATIVE_TOLERANCE)
    assert [r.device_id for r in per_device.reports] == [r.device_id for r in batched.reports]
    for report, twin in zip(per_device.reports, batched.reports, strict=True):
        assert report.personalized == pytest.approx(twin.personalized, rel=RELATIVE_TOLERANCE)
    for agent, agent_batched in zip(per_device.agents, batched.agents, strict=True):
        kept, kept_batched = _kept(agent), _kept(agent_batched)
        assert (kept is None) == (kept_batched is None)
        if kept is not None and kept_batched is not None:
            assert _max_difference(kept, kept_batched) <= WEIGHT_TOLERANCE


def _kept(agent: DeviceAgent) -> dict[str, torch.Tensor] | None:
    """The personal state `agent` stored (None: none, e.g. stateless or nothing personal)."""
    assert agent.last_announcement is not None
    return agent.store.load(agent.contexts.plan(agent.last_announcement).fingerprint)


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_batched_rounds_equal_the_per_device_path(algorithm: str) -> None:
    # Execute
    per_device, none = _run(algorithm, "off", **FAMILIES[algorithm])
    batched, trainer = _run(algorithm, "on", **FAMILIES[algorithm])
    # Assert: every device round of both rounds trained stacked, to the same results
    assert none is None
    assert trainer is not None
    assert trainer.stacked_rounds == sum(r.participants for r in batched.records)
    _assert_same_run(per_device, batched)


def test_worker_processes_train_their_devices_batched_to_the_same_results() -> None:
    # Execute: each of 2 workers stacks its own devices
    per_device, _ = _run("fedalt", "off", **FAMILIES["fedalt"])
    batched, _ = _run("fedalt", "on", workers=2, **FAMILIES["fedalt"])
    # Assert
    assert _max_difference(per_device.final_shared, batched.final_shared) <= WEIGHT_TOLERANCE
    for one, other in zip(per_device.records, batched.records, strict=True):
        assert one.train_loss == pytest.approx(other.train_loss, rel=RELATIVE_TOLERANCE)


def test_an_update_without_phases_trains_per_device_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Execute
    per_device, _ = _run("selffl", "off")
    with caplog.at_level(logging.INFO, logger="device_agent.batched.trainer"):
        batched, trainer = _run("selffl", "on")
    # Assert: nothing stacked, the reason logged once, the run bit-identical
    assert trainer is not None
    assert trainer.stacked_rounds == 0
    reasons = [r.getMessage() for r in caplog.records if "declares no phases" in r.getMessage()]
    assert reasons == ["batched training: selffl trains per device (its update declares no phases)"]
    assert _max_difference(per_device.final_shared, batched.final_shared) == 0.0


def test_auto_batches_only_below_the_step_cost_threshold() -> None:
    # Assert
    assert isinstance(choose_trainer("auto", AUTO_MAX_STEP_MACS), Batched)
    assert choose_trainer("auto", AUTO_MAX_STEP_MACS + 1) is None
    assert isinstance(choose_trainer("on", 10 * AUTO_MAX_STEP_MACS), Batched)
    assert choose_trainer("off", 1) is None


def test_models_with_buffers_or_dropout_train_per_device() -> None:
    # Assert
    assert model_problem(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None
    assert "buffers" in str(model_problem(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))
    assert "dropout" in str(model_problem(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))))


def test_diverging_devices_decline_as_on_the_per_device_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Execute: a step size that makes every device's loss non-finite in round 1
    with pytest.raises(RoundError) as per_device:
        _run("fedavg", "off", lr=1e30)
    with caplog.at_level(logging.INFO), pytest.raises(RoundError) as batched:
        _run("fedavg", "on", lr=1e30)
    # Assert: the stacked step gave up, each device trained alone and declined with its reason
    assert str(batched.value) == str(per_device.value)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("batched training: stacked training failed") for m in said)
    declined = {m for m in said if m.endswith("train round 1 failed: training loss became nan")}
    assert len(declined) == 6


def test_the_hub_delivers_what_an_idle_hook_publishes_before_a_wait_ends() -> None:
    # Arrange
    hub = InProcessBroker()
    heard: list[bytes] = []
    listener, speaker = hub.connect("listener"), hub.connect("speaker")
    listener.subscribe("t", lambda topic, payload: heard.append(payload))
    kept = [b"late"]

    def speak_once() -> None:
        if kept:
            speaker.publish("t", kept.pop())

    hub.idle.append(speak_once)
    # Execute
    arrived = listener.wait_until(lambda: bool(heard), timeout_s=0)
    # Assert
    assert arrived
    assert heard == [b"late"]


class _Counting:
    """A local update without phases that records the order its rounds ran in."""

    name: ClassVar[str] = "counting"

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, ctx: LocalContext) -> LocalResult:
        self.ran.append(ctx.device_id)
        return LocalResult({}, 1, 0.0, {})

    def personalize(self, ctx: LocalContext) -> None:
        del ctx


def _context(device_id: str) -> LocalContext:
    model = nn.Linear(2, 1)
    split = Split(torch.zeros(1, 2), torch.zeros(1, 1))
    data = DeviceData(0, split, split, split)
    return LocalContext(
        model=model,
        task=load_task("sine"),
        data=data,
        split=ParamSplit.for_model(model, ()),
        config=AlgorithmConfig(),
        global_shared={},
        personal={},
        generator=torch.Generator(),
        device_id=device_id,
    )


def _unexpected(error: Exception) -> None:
    pytest.fail(f"the round failed: {error}")


def test_a_device_handed_a_second_round_first_gets_its_first_trained() -> None:
    # Arrange
    trainer, update, answered = Batched(), _Counting(), []
    trainer.submit(update, _context("a"), lambda r: answered.append("a1"), _unexpected)
    trainer.submit(update, _context("b"), lambda r: answered.append("b1"), _unexpected)
    # Execute
    trainer.submit(update, _context("a"), lambda r: answered.append("a2"), _unexpected)
    # Assert: the kept work ran and answered before the second round of "a" was kept
    assert answered == ["a1", "b1"]
    assert trainer.pending()
    trainer.flush()
    assert answered == ["a1", "b1", "a2"]
    assert update.ran == ["a", "b", "a"]
