"""Agent settings: precedence, data sources, and the shard a simulation device gets."""

from __future__ import annotations

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from device_agent.compute_threads import available_cores
from device_agent.runner import load_data
from device_agent.settings import AgentSettings
from pfl_tasks.base import PartitionSpec
from pfl_tasks.partition_settings import PartitionSettings
from pfl_tasks.registry import load_task


def test_a_shard_is_exactly_the_simulation_devices_data() -> None:
    # Prepare
    settings = AgentSettings.load(None, device_id="dev-0002", data_shard=2, num_shards=5, seed=4)
    task = load_task("digits")
    # Execute
    data = load_data(settings, task)
    expected = task.make_fleet(5, PartitionSpec(), 4)[2]
    # Assert
    assert torch.equal(data.train.inputs, expected.train.inputs)
    assert torch.equal(data.test.targets, expected.test.targets)


def test_flags_win_over_environment_over_file(tmp_path, monkeypatch) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('device_id = "from-file"\nfleet = "file-fleet"\ndata_shard = 1\nseed = 9\n')
    monkeypatch.setenv("PFL_FLEET", "env-fleet")
    settings = AgentSettings.load(config, seed=2)
    assert (settings.device_id, settings.fleet, settings.seed) == ("from-file", "env-fleet", 2)


def test_a_data_source_is_required() -> None:
    with pytest.raises(ValueError, match="--data-shard"):
        AgentSettings.load(None, device_id="dev-1")
    with pytest.raises(ValueError, match="below num_shards"):
        AgentSettings.load(None, device_id="dev-1", data_shard=20)


def test_the_agent_splits_data_exactly_as_the_simulation_from_one_config(
    tmp_path, monkeypatch
) -> None:
    # Prepare: one TOML and environment both programs read
    config = tmp_path / "fleet.toml"
    config.write_text('partition = "shards"\nlabels_per_device = 3\ngroups = 4\nfraction = 0.5\n')
    monkeypatch.setenv("PFL_ALPHA", "0.25")
    # Execute
    agent = AgentSettings.load(config, device_id="dev-0001", data_shard=1)
    simulation = SimulationSettings.load(config)
    # Assert
    assert isinstance(agent, PartitionSettings)
    assert isinstance(simulation, PartitionSettings)
    expected = PartitionSpec("shards", alpha=0.25, labels_per_device=3, groups=4, fraction=0.5)
    assert agent.partition_spec() == simulation.partition_spec() == expected


def test_the_default_device_id_is_this_machines_and_valid(monkeypatch) -> None:
    from device_agent.identity import default_device_id
    from protocols import topics

    monkeypatch.delenv("PFL_DEVICE_ID", raising=False)
    first, again = default_device_id(), default_device_id()
    assert first == again
    assert topics.device_id_problem(first) is None
    assert AgentSettings(data_shard=0).device_id == first
    assert AgentSettings(data_shard=0, device_id="pi-kitchen").device_id == "pi-kitchen"
    monkeypatch.setattr("socket.gethostname", lambda: "pfl-coordinator")  # a reserved prefix
    assert default_device_id().startswith("device-")


def test_threads_cap_training_and_default_to_the_cores_available() -> None:
    def ceiling(**values: object) -> int:
        return AgentSettings.load(None, device_id="d", data_shard=0, **values).thread_ceiling()

    assert ceiling(threads=1) == 1
    assert ceiling() == available_cores()
    with pytest.raises(ValueError, match="threads"):
        ceiling(threads=-1)
