"""The docs are current and their commands run: docs/cli.md, README.md and docs/quickstart.md."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from benchmarks.doc_commands import fenced_commands
from coordinator.cli.app import app as coord_app
from coordinator.cli.docs import CLI_MD, render_cli_docs
from coordinator.stages.compatibility import COMPATIBILITY_MD, render_compatibility_docs
from device_agent.cli import app as agent_app
from tests.conftest import free_port, wait_for_port
from tests.e2e.conftest import child_env, sourced, with_sourced_files

REPO = Path(__file__).resolve().parent.parent
APPS = {"pfl-coord": coord_app, "pfl-agent": agent_app}
# Tiny settings replace the documented ones (a missing flag is added for simulate and compare).
TINY = {"--devices": "4", "--rounds": "2", "--pretrain-rounds": "1", "--seeds": "1"}
IN_PROCESS = {"simulate", "compare", "report"}


def tiny(words: list[str]) -> list[str]:
    """A documented command with tiny settings, keeping every other flag as written."""
    words = list(words)
    for flag, value in TINY.items():
        if flag in words:
            words[words.index(flag) + 1] = value
        elif words[1] in ("simulate", "compare") and flag in ("--devices", "--rounds"):
            words += [flag, value]
    return words


def parses(words: list[str]) -> None:
    """The command line is valid for its program: known command, known flags, right types."""
    group = typer.main.get_command(APPS[words[0]])
    assert isinstance(group, typer.core.TyperGroup)
    command = group.commands[words[1]]
    command.make_context(" ".join(words[:2]), words[2:])


def test_cli_md_is_current() -> None:
    assert CLI_MD.read_text() == render_cli_docs(), (
        "docs/cli.md is out of date: run `python -m coordinator.cli.docs`"
    )


def test_compatibility_md_is_current() -> None:
    assert COMPATIBILITY_MD.read_text() == render_compatibility_docs(), (
        "docs/compatibility.md is out of date: run `python -m coordinator.stages.compatibility`"
    )


def test_cli_md_documents_every_command() -> None:
    text = CLI_MD.read_text()
    for program, app in APPS.items():
        group = typer.main.get_command(app)
        assert isinstance(group, typer.core.TyperGroup)
        for name in group.commands:
            assert f"### `{program} {name}`" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_simulate_compare_report_commands_run_as_written(tmp_path, monkeypatch) -> None:
    # Prepare: README's "Two commands" and "Using it" sections, and the quickstart
    readme = fenced_commands((REPO / "README.md").read_text(), ("Two commands", "Using it"))
    quickstart = fenced_commands((REPO / "docs" / "quickstart.md").read_text())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-run.toml").write_text("# the README's example config file\n")
    runner = CliRunner()
    ran, checked = [], []
    # Execute
    for words in readme + quickstart:
        if words[0] not in APPS or "..." in words:
            continue  # pip and pytest; an elided line ("simulate ... --transport mqtt")
        if words[0] == "pfl-coord" and words[1] in IN_PROCESS:
            command = tiny(words)
            result = runner.invoke(coord_app, command[1:])
            assert result.exit_code == 0, f"{shlex.join(command)}:\n{result.output}"
            ran.append(command)
        else:  # fleet commands: the quickstart fleet test runs them; here they must parse
            parses(words)
            checked.append(words)
    # Assert: the documented outputs exist
    assert len(ran) >= 8
    assert (tmp_path / "runs" / "cmp" / "comparison.md").is_file()
    assert (tmp_path / "runs" / "cmp" / "plots" / "accuracy.png").is_file()
    assert (tmp_path / "runs" / "first" / "plots" / "device_histogram.png").is_file()
    assert any(w[1] == "serve" for w in checked)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quickstart_fleet_runs_as_written(tmp_path: Path) -> None:
    """Serve with the embedded broker, two agents, status, then the offline export."""
    # Prepare: the quickstart's fleet commands, on a free port and with 2 rounds
    commands = fenced_commands((REPO / "docs" / "quickstart.md").read_text())
    port = free_port()

    def local(words: list[str]) -> list[str]:
        text = shlex.join(tiny(words)).replace("127.0.0.1:1883", f"127.0.0.1:{port}")
        return shlex.split(text)

    by_name: dict[str, list[list[str]]] = {}
    env_files: dict[str, str | None] = {}  # what each command's terminal sourced before it
    for words, env_file in with_sourced_files(commands):
        by_name.setdefault(" ".join(words[:2]), []).append(local(words))
        env_files[shlex.join(local(words))] = env_file
    (serve,) = by_name["pfl-coord serve"]
    agents = by_name["pfl-agent start"]
    (status,) = by_name["pfl-coord status"]
    (export,) = by_name["pfl-agent export"]
    assert len(agents) == 2
    children: list[subprocess.Popen[bytes]] = []

    def env_of(words: list[str]) -> dict[str, str]:
        env_file = env_files.get(shlex.join(words))
        return {**child_env(), **(sourced(tmp_path / env_file) if env_file else {})}

    def start(words: list[str], log: str) -> subprocess.Popen[bytes]:
        with (tmp_path / log).open("wb") as handle:
            child = subprocess.Popen(
                words, cwd=tmp_path, env=env_of(words), stdout=handle, stderr=subprocess.STDOUT
            )
        children.append(child)
        return child

    def log(name: str) -> str:
        return (tmp_path / name).read_text(errors="replace")

    try:
        # Execute: the coordinator with its embedded broker, then the agents once it listens
        coordinator = start([*serve, "--port", str(port), "--round-timeout", "60"], "serve.log")
        assert wait_for_port(port, timeout_s=60), log("serve.log")
        for index, words in enumerate(agents):
            start(words, f"agent-{index}.log")
        shown = subprocess.run(
            status, cwd=tmp_path, env=env_of(status), capture_output=True, timeout=60
        )
        serving = f"serve (exit {coordinator.poll()}):\n{log('serve.log')}"
        assert shown.returncode == 0, f"{shown.stderr.decode()}\n{serving}"
        assert coordinator.wait(timeout=150) == 0, log("serve.log")
        for child in children[1:]:
            child.send_signal(signal.SIGINT)  # Ctrl-C
            child.wait(timeout=30)
        exported = subprocess.run(
            export, cwd=tmp_path, env=env_of(export), capture_output=True, timeout=90
        )
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
    # Assert
    assert "embedded MQTT broker listening on" in log("serve.log")
    assert (tmp_path / "runs" / "fleet" / "summary.json").is_file()
    assert exported.returncode == 0, exported.stderr.decode() + exported.stdout.decode()
    assert (tmp_path / "dev-1.onnx").stat().st_size > 1000
    parses(by_name["pfl-coord export"][0])


def test_fenced_commands_split_lines_chains_and_comments() -> None:
    text = "```bash\npip install x && pfl-coord simulate --a 1 \\\n   --b 2  # note\npytest\n```\n"
    assert fenced_commands(text) == [
        ["pip", "install", "x"],
        ["pfl-coord", "simulate", "--a", "1", "--b", "2"],
        ["pytest"],
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_first_result_is_what_its_command_prints(tmp_path, monkeypatch) -> None:
    # Prepare: the README's first command exactly as written (no tiny settings)
    text = (REPO / "README.md").read_text()
    simulate = next(
        w for w in fenced_commands(text, ("Two commands",)) if w[:2] == ["pfl-coord", "simulate"]
    )
    quoted = dict(re.findall(r"`(personalized_mean|global) (\d\.\d{4})`", text))
    monkeypatch.chdir(tmp_path)
    # Execute
    result = CliRunner().invoke(coord_app, simulate[1:], terminal_width=120)
    # Assert: the numbers the README quotes are the printed ones, and personalization helps
    assert result.exit_code == 0, result.output
    for name in ("personalized_mean", "global"):
        assert re.search(rf"{name}\s+│\s+{quoted[name]}\b", result.output), (name, result.output)
    assert float(quoted["personalized_mean"]) > float(quoted["global"])
