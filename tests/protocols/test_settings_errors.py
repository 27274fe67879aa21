"""Settings errors are one line naming the flag, the value and what is allowed."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator
from typer.testing import CliRunner

from coordinator.cli.app import app as coord_app
from device_agent.cli import app as agent_app
from protocols.settings_errors import describe_settings_error


class _Settings(BaseModel):
    devices: Annotated[int, Field(ge=1)] = 2
    learning_rate: Annotated[float, Field(gt=0, lt=1)] = 0.1
    partition: Literal["iid", "dirichlet"] = "iid"
    shard: str = "0-3"

    @field_validator("shard")
    @classmethod
    def _range(cls, value: str) -> str:
        if "-" not in value:
            msg = f"expected a range such as 0-499, got {value!r}"
            raise ValueError(msg)
        return value


def _problem(**values: object) -> str:
    with pytest.raises(ValidationError) as caught:
        _Settings(**values)  # type: ignore[arg-type]
    return describe_settings_error(caught.value)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"devices": 0}, "--devices 0: must be at least 1"),
        ({"learning_rate": 1.5}, "--learning-rate 1.5: must be below 1.0"),
        ({"learning_rate": 0}, "--learning-rate 0: must be above 0.0"),
        ({"partition": "zipf"}, "--partition zipf: expected 'iid' or 'dirichlet'"),
        ({"shard": "7"}, "--shard 7: expected a range such as 0-499, got '7'"),
        ({"devices": "many"}, "--devices many: must be a valid integer, unable to parse string"),
    ],
)
def test_each_problem_names_flag_value_and_range(values: dict[str, object], expected: str) -> None:
    assert _problem(**values).startswith(expected)


def test_several_problems_share_one_line() -> None:
    line = _problem(devices=-1, partition="zipf")
    assert line.count(";") == 1
    assert "\n" not in line


@pytest.mark.parametrize(
    ("app", "args", "expected"),
    [
        (coord_app, ["simulate", "--devices", "0"], "error: --devices 0: must be at least 1"),
        (coord_app, ["simulate", "--rounds", "-1"], "error: --rounds -1: must be at least 1"),
        (
            agent_app,
            ["pool", "--devices", "5-2", "--num-shards", "4"],
            "error: --devices '5-2': expected a range",
        ),
    ],
)
def test_commands_print_one_line_and_exit_2(app: object, args: list[str], expected: str) -> None:
    result = CliRunner().invoke(app, args, terminal_width=60)  # type: ignore[arg-type]
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith(expected)
    assert "pydantic" not in result.output
    assert "http" not in result.output
