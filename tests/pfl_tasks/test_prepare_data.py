"""A device's --data directory from a CSV or arrays, and the agent's check of it at start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from device_agent.cli import app as agent_app
from device_agent.runner import load_data
from device_agent.settings import AgentSettings
from pfl_tasks.base import PartitionSpec
from pfl_tasks.datadir import load_device_data, read_csv_columns, save_device_data, split_arrays
from pfl_tasks.registry import load_task


def _csv(path: Path, labels: list[str]) -> Path:
    rows = ["a,b,label", *(f"{i}.5,{-i},{label}" for i, label in enumerate(labels))]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_whole_number_targets_become_class_labels_and_the_rest_inputs(tmp_path: Path) -> None:
    inputs, targets = read_csv_columns(_csv(tmp_path / "d.csv", ["0", "2", "1.0"]), "label")

    assert inputs.tolist() == [[0.5, 0.0], [1.5, -1.0], [2.5, -2.0]]
    assert targets.dtype == np.int64
    assert targets.tolist() == [0, 2, 1]


def test_fractional_targets_stay_values(tmp_path: Path) -> None:
    _, targets = read_csv_columns(_csv(tmp_path / "d.csv", ["0.25", "2"]), "label")

    assert targets.dtype == np.float64


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("a,b,label\n1,x,0\n", "non-numeric value"),
        ("a,b\n1,2\n", "no column 'label'"),
        ("label\n1\n", "no input column"),
        ("a,b,label\n", "at least one data row"),
    ],
)
def test_bad_csv_files_get_one_clear_line(tmp_path: Path, content: str, says: str) -> None:
    (tmp_path / "d.csv").write_text(content)

    with pytest.raises(ValueError, match=says):
        read_csv_columns(tmp_path / "d.csv", "label")


def test_split_arrays_uses_the_simulation_shares_and_keeps_every_sample() -> None:
    data = split_arrays(np.arange(80.0).reshape(40, 2), np.arange(40), PartitionSpec(), seed=1)

    assert (len(data.train), len(data.val), len(data.test)) == (26, 4, 10)
    together = np.concatenate([data.train.targets, data.val.targets, data.test.targets])
    assert sorted(together.tolist()) == list(range(40))


def test_prepare_data_writes_what_the_agent_reads(tmp_path: Path) -> None:
    # Prepare
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(30, 64)))
    np.save(tmp_path / "y.npy", np.arange(30) % 10)

    # Execute
    result = CliRunner().invoke(
        agent_app,
        [
            "prepare-data",
            "--inputs",
            str(tmp_path / "x.npy"),
            "--targets",
            str(tmp_path / "y.npy"),
            "--out",
            str(tmp_path / "dev"),
        ],
    )

    # Assert
    assert result.exit_code == 0, result.output
    data = load_device_data(tmp_path / "dev")
    assert len(data.train) + len(data.val) + len(data.test) == 30
    assert data.train.inputs.shape[1:] == (64,)


def test_prepare_data_refuses_half_an_input(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        agent_app, ["prepare-data", "--inputs", "x.npy", "--out", str(tmp_path / "dev")]
    )

    assert result.exit_code != 0
    assert "give --csv FILE --target COLUMN, or --inputs X.npy --targets Y.npy" in result.output


def test_the_agent_refuses_data_its_model_cannot_take_before_connecting(tmp_path: Path) -> None:
    # Prepare: 5 features for the digits MLP's 64 inputs
    data = split_arrays(np.zeros((20, 5)), np.zeros(20, dtype=np.int64), PartitionSpec(), 0)
    save_device_data(data, tmp_path / "dev")
    settings = AgentSettings.load(None, task="digits", data=tmp_path / "dev", device_id="d0")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"--data .*dev: inputs of per-sample shape \(5,\)"):
        load_data(settings, load_task("digits"))
