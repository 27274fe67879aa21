import json
import os

import pytest
import torch

from coordinator.engine.rounds import EngineSettings
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.agent import DeviceAgent
from device_agent.state_store import DiskStateStore, MemoryStateStore, StateStore
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols.errors import StateError
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents, hub_coordinator, hub_engine


def _fleet(tmp_path, algorithm_options: dict[str, object]):
    settings = SimulationSettings.load(
        None,
        workers=1,
        task="digits",
        algorithm="fedalt",
        devices=1,
        rounds=5,
        algorithm_options=algorithm_options,
    )
    task = load_task("digits")
    broker = InProcessBroker()
    coordinator = hub_engine(broker, settings, EngineSettings(task="digits", rounds=5))
    data = task.make_fleet(4, PartitionSpec(), 0)[0]

    def agent() -> DeviceAgent:
        workspace = task.build_model(0)
        device = DeviceAgent(
            device_id="dev-0000",
            fleet="default",
            transport=broker.connect("dev-0000"),
            task=task,
            data=data,
            seed=0,
            store=DiskStateStore(tmp_path / "state"),
            workspace=workspace,
            initial_state={k: v.clone() for k, v in workspace.state_dict().items()},
        )
        device.start()
        return device

    return coordinator, agent


def _stored(tmp_path) -> dict[str, torch.Tensor]:
    store = DiskStateStore(tmp_path / "state")
    record = (tmp_path / "state" / "personal.json").read_text()
    fingerprint = json.loads(record)["fingerprint"]
    return _loaded(store, fingerprint)


def _loaded(store: StateStore, fingerprint: str, run_id: str = "") -> dict[str, torch.Tensor]:
    """The stored tensors, which the test expects to be there."""
    tensors = store.load(fingerprint, run_id)
    assert tensors is not None, f"nothing stored for {fingerprint} in run {run_id!r}"
    return tensors


def test_personal_state_survives_an_agent_restart(tmp_path) -> None:
    # Prepare: two FedAlt rounds with one agent process-equivalent
    coordinator, agent = _fleet(tmp_path, {"finetune_epochs": 0})
    first = agent()
    coordinator.start()
    coordinator.wait_for_devices(1, 1.0)
    coordinator.run_round()
    coordinator.run_round()
    before = _stored(tmp_path)
    initial = load_task("digits").build_model(0).state_dict()
    assert not torch.equal(before["output.weight"], initial["output.weight"])
    first.transport.close()
    # Execute: a new agent on the same state directory takes part in a round whose personal
    # phase is empty (FedAlt with personal_epochs=0 keeps v as loaded)
    coordinator.strategy.config = coordinator.strategy.config.model_copy(
        update={"personal_epochs": 0}
    )
    agent()
    coordinator.wait_for_devices(1, 1.0)
    coordinator.run_round()
    # Assert: it resumed from the stored personal state, not from the initialization
    after = _stored(tmp_path)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_a_corrupt_state_file_is_refused_clearly(tmp_path) -> None:
    coordinator, agent = _fleet(tmp_path, {})
    agent()
    coordinator.start()
    coordinator.wait_for_devices(1, 1.0)
    coordinator.run_round()
    (tmp_path / "state" / "personal.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(StateError, match="corrupt"):
        _stored(tmp_path)


def test_state_of_another_architecture_is_refused_with_the_reset_hint(tmp_path) -> None:
    store = DiskStateStore(tmp_path)
    store.save("fingerprint-a", {"output.weight": torch.ones(2, 2)})
    with pytest.raises(StateError, match="reset-state"):
        store.load("fingerprint-b")


def test_a_failed_write_keeps_the_previous_good_state(tmp_path, monkeypatch) -> None:
    # Prepare
    store = DiskStateStore(tmp_path)
    store.save("fp", {"output.weight": torch.ones(2, 2)})

    def disk_full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    # Execute
    with pytest.raises(StateError, match="No space left"):
        store.save("fp", {"output.weight": torch.zeros(2, 2)})
    monkeypatch.undo()
    # Assert
    assert torch.equal(_loaded(store, "fp")["output.weight"], torch.ones(2, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["personal.json", "personal.safetensors"]


def test_stateless_devices_keep_nothing_and_stateful_ones_keep_their_part() -> None:
    common = {"task": "digits", "algorithm": "fedalt", "devices": 3, "rounds": 2, "seed": 0}
    stateless = run_simulation(SimulationSettings.load(None, workers=1, stateless=True, **common))
    stateful = run_simulation(SimulationSettings.load(None, workers=1, **common))
    assert all(
        isinstance(agent.store, MemoryStateStore) and agent.store._tensors is None
        for agent in stateless.agents
    )
    for agent in stateful.agents:
        assert isinstance(agent.store, MemoryStateStore)
        assert set(agent.store._tensors or ()) == {"output.weight", "output.bias"}
    assert stateless.summary.metrics != stateful.summary.metrics


def test_a_new_run_starts_fresh_and_sets_the_earlier_runs_state_aside(tmp_path) -> None:
    # Prepare: state of run A on disk
    store = DiskStateStore(tmp_path / "state")
    run_a, run_b = "a" * 32, "b" * 32
    store.save("fp", {"output.weight": torch.ones(2, 2)}, run_a)
    # Execute / Assert: run B sees nothing of run A's, which stays readable where it was moved
    assert store.load("fp", run_b) is None
    assert torch.equal(_loaded(store, "fp", run_a)["output.weight"], torch.ones(2, 2))
    store.save("fp", {"output.weight": torch.zeros(2, 2)}, run_b)
    assert torch.equal(_loaded(store, "fp", run_b)["output.weight"], torch.zeros(2, 2))
    assert store.load("fp", run_a) is None
    earlier = DiskStateStore(tmp_path / "state" / "earlier-runs" / run_a)
    assert torch.equal(_loaded(earlier, "fp", run_a)["output.weight"], torch.ones(2, 2))
    # state from before run ids existed counts as another run's too
    legacy = DiskStateStore(tmp_path / "legacy")
    legacy.save("fp", {"output.weight": torch.ones(1)})
    assert legacy.load("fp", run_a) is None
    assert legacy.load("fp") is not None


def test_a_fresh_run_trains_from_the_start_not_from_an_earlier_runs_state(tmp_path) -> None:
    # Prepare: one round of a stateful algorithm, then a fresh coordinator on the same state dir
    coordinator, agent = _fleet(tmp_path, {})
    device = agent()
    coordinator.start()
    assert coordinator.wait_for_devices(1, 5.0)
    coordinator.run_round()
    first_run, after_one_round = coordinator.run_id, _stored(tmp_path)
    device.transport.close()
    coordinator.transport.close()
    fresh, fresh_agent = _fleet(tmp_path, {})
    restarted = fresh_agent()
    fresh.start()
    assert fresh.wait_for_devices(1, 5.0)
    # Execute
    fresh.run_round()
    # Assert: the same seed from the same start gives the same state as run A's first round
    # (continuing from run A's state would not), and run A's state was moved, not lost
    assert fresh.run_id != first_run
    record = json.loads((tmp_path / "state" / "personal.json").read_text())
    assert record["run_id"] == fresh.run_id
    again = _stored(tmp_path)
    assert all(torch.equal(again[k], after_one_round[k]) for k in after_one_round)
    earlier = DiskStateStore(tmp_path / "state" / "earlier-runs" / first_run)
    assert all(
        torch.equal(_loaded(earlier, record["fingerprint"], first_run)[k], after_one_round[k])
        for k in after_one_round
    )
    restarted.transport.close()
    fresh.transport.close()


def test_an_unusable_state_dir_declines_the_round_with_the_reason(tmp_path) -> None:
    # Prepare: two devices of a stateful algorithm; one's state dir lies under a regular file
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the state directory should be")
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedalt", 2, 1)
    state_dirs = (blocker / "state", tmp_path / "good")
    hub_agents(broker, ["dev-0", "dev-1"], lambda i: {"store": DiskStateStore(state_dirs[i])})
    coordinator.start()
    assert coordinator.wait_for_devices(2, 1.0)
    # Execute: the round closes as soon as the broken device declined (not at the deadline)
    record = coordinator.run_round()
    # Assert
    assert record.participants == 1
    assert record.skipped == 1
    (broken,) = [r for r in coordinator.registry.records() if r.device_id == "dev-0"]
    assert "Not a directory" in broken.detail
