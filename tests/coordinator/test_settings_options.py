"""The programs' flags come from their settings models: each declared once, old names working."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

from coordinator.cli import app as coord_cli
from coordinator.run.settings import ServeSettings, SimulationSettings
from device_agent import cli as agent_cli
from device_agent.settings import AgentSettings, PoolSettings
from protocols.program_settings import BrokerAccess
from protocols.settings_options import command_settings
from protocols.settings_sections import settings_of

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    (coord_cli.app, "simulate", SimulationSettings, coord_cli.SIMULATE_TOML_ONLY),
    (coord_cli.app, "serve", ServeSettings, coord_cli.SERVE_TOML_ONLY),
    (agent_cli.app, "start", AgentSettings, ()),
    (agent_cli.app, "pool", PoolSettings, ()),
]
OWN = {"config", "verbose", "help"}


def _command(app: typer.Typer, name: str) -> Any:
    group: Any = typer.main.get_command(app)
    return group.commands[name]


@pytest.mark.parametrize(("app", "name", "model", "toml_only"), COMMANDS)
def test_every_flag_is_one_setting_declared_once(
    app: typer.Typer, name: str, model: type[BaseModel], toml_only: tuple[str, ...]
) -> None:
    # Arrange
    params = [p for p in _command(app, name).params if p.name not in OWN]
    settings = {s.flat: s for s in settings_of(model)}
    offered = {s.flat for s in command_settings(model, exclude=toml_only)}

    # Assert: one option per setting, named after it, with the field's help and default
    names = [p.name for p in params]
    flags = [opt for p in params for opt in (*p.opts, *p.secondary_opts)]
    assert len(set(names)) == len(names)
    assert len(set(flags)) == len(flags)
    assert set(names) == offered
    for param in params:
        field = settings[str(param.name)].field
        assert param.opts == ["--" + str(param.name).replace("_", "-")]
        assert getattr(param, "help", None) == field.description
        assert param.default is None or param.required  # not given: env and file may set it
        shown = getattr(param, "show_default", None)
        if shown:
            assert shown == str(field.default)
    # and every setting a command line can carry is a flag, but those left to the file
    typed = {s.flat for s in command_settings(model)}
    assert typed - offered == set(toml_only)


def test_no_command_lists_its_settings_or_passes_locals() -> None:
    clis = [ROOT / "device_agent/cli.py", *sorted((ROOT / "coordinator/cli").glob("*.py"))]
    for path in clis:
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert not [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "locals"]
        if path.name not in ("app.py", "cli.py"):  # the fleet commands' own options are many
            continue
        for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            arguments = function.args
            count = len(arguments.args) + len(arguments.kwonlyargs)
            assert count <= 8, f"{path.name}: {function.name} takes {count} parameters"


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The settings `simulate`, `serve` or `pfl-agent start` would run with."""
    seen: list[Any] = []

    def capture(settings: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(settings)
        raise typer.Exit(0)

    monkeypatch.setattr(coord_cli, "_run_with_progress", capture)
    monkeypatch.setattr(agent_cli, "run_agent", capture)
    for name in ("PFL_DP_CLIP", "PFL_DP__CLIP", "PFL_BUFFER", "PFL_ASYNC__BUFFER"):
        monkeypatch.delenv(name, raising=False)
    return seen


def _invoke(app: typer.Typer, args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


def test_the_old_flags_set_the_nested_settings(captured: list[Any]) -> None:
    # Act
    _invoke(
        coord_cli.app,
        [
            "simulate",
            "--dp-noise",
            "1.0",
            "--dp-clip",
            "2.5",
            "--secagg",
            "--buffer",
            "3",
            "--compress",
            "int8",
            "--compress-down",
            "int8",
            "--norm-bound",
            "2",
            "--sim-speeds",
            "lognormal:10",
            "--personal",
            "head.*",
            "--personal",
            "fc.*",
        ],
    )

    # Assert
    [settings] = captured
    assert (settings.dp.noise, settings.dp.clip, settings.secagg.enabled) == (1.0, 2.5, True)
    assert (settings.asynchronous.buffer, settings.guard.norm_bound) == (3, 2.0)
    assert (settings.compress.up, settings.compress.down) == ("int8", "int8")
    assert settings.sim.speeds == "lognormal:10"
    assert settings.personal == ["head.*", "fc.*"]
    privacy = settings.privacy()
    assert privacy is not None
    assert privacy.clip_norm == 2.5


def test_serve_and_the_agent_take_their_flags(captured: list[Any], tmp_path: Path) -> None:
    _invoke(coord_cli.app, ["serve", "--dashboard", "127.0.0.1:0", "--dashboard-token", "t0k"])
    _invoke(agent_cli.app, ["start", "--data-shard", "3", "--max-epochs", "5", "--tls-insecure"])

    serve, agent = captured
    board = serve.dashboard_settings()
    assert board is not None
    assert (board.listen, board.token) == ("127.0.0.1:0", "t0k")
    assert (agent.data_shard, agent.limits.max_epochs, agent.tls_insecure) == (3, 5, True)


FLAT = """
dp_noise = 1.0
dp_clip = 0.5
dp_mechanism = "ftrl-tree"
secagg = true
secagg_neighbors = 4
mode = "async"
buffer = 4
staleness = "hinge"
norm_bound = 2.0
compress = "topk:0.1"
compress_down = "int8"
sim_speeds = "lognormal:5"
sim_deadline = 30.0
[dp_options]
tree_restart = 5
"""
NESTED = """
mode = "async"
[dp]
noise = 1.0
clip = 0.5
mechanism = "ftrl-tree"
[dp.options]
tree_restart = 5
[secagg]
enabled = true
neighbors = 4
[async]
buffer = 4
staleness = "hinge"
[guard]
norm_bound = 2.0
[compress]
up = "topk:0.1"
down = "int8"
[sim]
speeds = "lognormal:5"
deadline = 30.0
"""


def test_nested_and_flat_toml_give_the_same_settings(tmp_path: Path) -> None:
    # Arrange
    (tmp_path / "flat.toml").write_text(FLAT)
    (tmp_path / "nested.toml").write_text(NESTED)

    # Act
    flat = SimulationSettings.load(tmp_path / "flat.toml")
    nested = SimulationSettings.load(tmp_path / "nested.toml")

    # Assert: the same settings, none of them left at its default
    assert flat == nested
    assert nested != SimulationSettings.model_validate({})
    assert nested.dp.options == {"tree_restart": 5}
    assert nested.asynchronous.buffer == 4
    assert nested.model_dump()["secagg_neighbors"] == 4


def test_flags_win_over_variables_over_the_file_in_either_spelling(
    captured: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: the file sets three settings nested; variables two of them, flat and nested
    config = tmp_path / "run.toml"
    config.write_text("[dp]\nclip = 3.0\nnoise = 1.0\n[async]\nbuffer = 5\n")
    monkeypatch.setenv("PFL_DP_CLIP", "2.0")
    monkeypatch.setenv("PFL_ASYNC__BUFFER", "6")

    # Act
    _invoke(coord_cli.app, ["simulate", "--config", str(config)])
    _invoke(coord_cli.app, ["simulate", "--config", str(config), "--dp-clip", "1.5"])

    # Assert
    by_env, by_flag = captured
    assert (by_env.dp.clip, by_env.dp.noise, by_env.asynchronous.buffer) == (2.0, 1.0, 6)
    assert (by_flag.dp.clip, by_flag.dp.noise, by_flag.asynchronous.buffer) == (1.5, 1.0, 6)


@pytest.mark.parametrize(
    ("toml", "args", "expected"),
    [
        ("", ["--dp-clip", "0"], "error: --dp-clip 0.0: must be above 0"),
        ("[dp]\nclip = 0\n", [], "error: --dp-clip 0: must be above 0"),
        ("[async]\nfair_share = 0.5\n", [], "error: --fair-share 0.5: fair_share: 0 (off)"),
        ("buffer = 2\n[async]\nbuffer = 3\n", [], "error: [async] buffer and buffer are the"),
    ],
)
def test_bad_values_name_the_flag_in_either_spelling(
    tmp_path: Path, toml: str, args: list[str], expected: str
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(toml)

    result = CliRunner().invoke(coord_cli.app, ["simulate", "--config", str(config), *args])

    assert result.exit_code == 2
    assert result.output.strip().startswith(expected), result.output


@pytest.mark.parametrize("name", ["status", "export", "dashboard"])
def test_the_fleet_commands_take_the_broker_settings_once(name: str) -> None:
    # Prepare
    params = _command(coord_cli.app, name).params
    declared = [s.flat for s in settings_of(BrokerAccess)]

    # Assert: each broker setting one option, also read from its PFL_* variable
    taken = {str(p.name): p for p in params if p.name in declared}
    assert sorted(taken) == sorted(declared)
    for flat, param in taken.items():
        assert param.envvar == f"PFL_{flat.upper()}"
        assert getattr(param, "help", None) == BrokerAccess.model_fields[flat].description


def test_the_agents_limits_table_and_flat_keys_agree(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "flat.toml").write_text("data_shard = 1\nmax_epochs = 4\nmax_steps = 50\n")
    (tmp_path / "nested.toml").write_text(
        "data_shard = 1\n[limits]\nmax_epochs = 4\nmax_steps = 50\n"
    )

    # Execute
    flat = AgentSettings.load(tmp_path / "flat.toml", device_id="dev-1")
    nested = AgentSettings.load(tmp_path / "nested.toml", device_id="dev-1")

    # Assert
    assert flat == nested
    assert (nested.work_limits().max_epochs, nested.work_limits().max_steps) == (4, 50)
