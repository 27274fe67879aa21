"""`pfl-agent start/pool --model`: the device builds the model the coordinator's --model names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from torch import nn
from typer.testing import CliRunner

from device_agent.cli import app
from device_agent.received import DecodedModelCache, ReceivedModel
from device_agent.settings import AgentSettings, PoolSettings
from pfl_tasks.registry import load_task
from protocols.codec import describe_tensors, pack_tensors
from protocols.errors import ProtocolError
from protocols.messages import SharedModel


def test_start_builds_the_named_model() -> None:
    # Execute
    settings = AgentSettings(task="mnist1d", model="gru", data_shard=0, num_shards=4)
    model = load_task(settings.task, settings.task_options).build_model(0)
    # Assert: the option reaches the task, and the task builds a recurrent model
    assert settings.task_options == {"model": "gru"}
    assert any(isinstance(m, nn.GRU) for m in model.modules())


def test_a_pool_takes_the_model_as_start_does() -> None:
    settings = PoolSettings(devices="0-1", num_shards=2, task="mnist1d", model="linear")
    assert settings.task_options == {"model": "linear"}


def test_without_model_the_options_are_left_as_given() -> None:
    settings = AgentSettings(task="mnist1d", data_shard=0, task_options={"model": "mlp"})
    assert settings.task_options == {"model": "mlp"}


@pytest.mark.parametrize(
    ("task", "model", "says"),
    [
        ("mnist1d", "lstm", "valid models: cnn, cnn-bn, cnn-paper, gru, mlp, linear"),
        ("sine", "cnn", "offers no choice of model"),
    ],
)
def test_a_model_the_task_does_not_offer_is_refused(task: str, model: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        AgentSettings(task=task, model=model, data_shard=0)


def test_a_model_contradicting_the_options_is_refused() -> None:
    with pytest.raises(ValidationError, match="contradicts"):
        AgentSettings(task="mnist1d", model="gru", data_shard=0, task_options={"model": "mlp"})


def test_pfl_agent_start_refuses_an_unknown_model_in_one_line(tmp_path) -> None:
    # Execute: refused while settings load, before the broker is dialled (nothing on port 1)
    result = CliRunner().invoke(
        app,
        ["start", "--broker", "mqtt://127.0.0.1:1", "--task", "mnist1d", "--model", "lstm",
         "--data-shard", "0", "--num-shards", "2", "--state-dir", str(tmp_path)],
    )  # fmt: skip
    # Assert
    assert result.exit_code == 2, result.output
    assert "valid models" in result.output
    assert "Traceback" not in result.output


def test_a_model_of_another_layout_is_refused_with_the_flags_to_check() -> None:
    # Prepare: the coordinator's GRU arrives at an agent that builds the CNN
    gru = load_task("mnist1d", {"model": "gru"}).build_model(0)
    cnn = load_task("mnist1d", {"model": "cnn"}).build_model(0)
    manifest, blob = pack_tensors(gru.state_dict())
    received = ReceivedModel(SharedModel(round_id=0, manifest=manifest), blob)
    # Execute / Assert
    with pytest.raises(ProtocolError, match="start it with the coordinator's --task and --model"):
        DecodedModelCache().decode(received, describe_tensors(cnn.state_dict()))


def test_a_damaged_model_of_the_right_layout_is_refused_without_that_hint() -> None:
    # Prepare: the agent's own model, one byte of its blob flipped
    cnn = load_task("mnist1d", {"model": "cnn"}).build_model(0)
    manifest, blob = pack_tensors(cnn.state_dict())
    damaged = bytearray(blob)
    damaged[-1] ^= 0xFF
    received = ReceivedModel(SharedModel(round_id=0, manifest=manifest), bytes(damaged))
    # Execute
    with pytest.raises(ProtocolError, match="checksum") as caught:
        DecodedModelCache().decode(received, describe_tensors(cnn.state_dict()))
    # Assert: a damaged model is not blamed on the agent's flags
    assert "--model" not in str(caught.value)
