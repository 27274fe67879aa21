"""Agent settings: precedence, data sources, and the shard a simulation device gets."""

from __future__ import annotations

import pytest
import torch

from device_agent.runner import load_data
from device_agent.settings import AgentSettings
from pfl_tasks.base import PartitionSpec
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
