"""docs/own-task.md runs as written: its files, its commands, a real fleet and the export."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from benchmarks.doc_commands import fenced_commands
from coordinator.cli.app import app as coord_app
from tests.conftest import free_port, wait_for_port
from tests.e2e.conftest import child_env, sourced, with_sourced_files
from tests.test_docs import tiny

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "own-task.md"


def write_guide_files(directory: Path) -> list[str]:
    """The guide's ```python blocks, each saved under the name its first line gives."""
    names = []
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL):
        name = block.splitlines()[0].removeprefix("#").strip()
        (directory / name).write_text(block)
        names.append(name)
    return names


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_own_task_guide_runs_as_written(tmp_path, monkeypatch) -> None:
    # Prepare
    assert write_guide_files(tmp_path) == ["my_task.py", "split_for_devices.py"]
    monkeypatch.chdir(tmp_path)
    env = {**child_env(), "PYTHONPATH": str(REPO)}
    port = free_port()
    documented = with_sourced_files(fenced_commands(GUIDE.read_text()))
    env_files: dict[str, str | None] = {}  # what each command's terminal sourced before it
    commands = []
    for words, env_file in documented:
        local = shlex.join(tiny(words)).replace("127.0.0.1:1883", f"127.0.0.1:{port}")
        commands.append(shlex.split(local))
        env_files[local] = env_file
    fleet = [w for w in commands if w[:2] in (["pfl-coord", "serve"], ["pfl-agent", "start"])]
    export = [w for w in commands if w[:2] == ["pfl-agent", "export"]]
    steps = [w for w in commands if w not in fleet and w not in export]

    # Execute: the simulation in-process; files, data preparation as the user's shell would
    printed = {}
    for words in steps:
        if words[:2] == ["pfl-coord", "simulate"]:
            result = CliRunner().invoke(coord_app, words[1:])
            assert result.exit_code == 0, result.output
            continue
        program = [sys.executable, *words[1:]] if words[0] == "python" else words
        done = subprocess.run(program, cwd=tmp_path, env=env, capture_output=True, timeout=120)
        assert done.returncode == 0, shlex.join(words) + done.stderr.decode()
        printed[shlex.join(words)] = done.stdout.decode()
    # ... then the fleet: the coordinator with its embedded broker, two agents on their --data
    serve, *agents = fleet
    logs = []
    children = []
    try:
        for index, words in enumerate([[*serve, "--port", str(port)], *agents]):
            log = (tmp_path / f"fleet-{index}.log").open("wb")
            logs.append(log)
            env_file = env_files.get(shlex.join(words))
            sourced_env = {**env, **(sourced(tmp_path / env_file) if env_file else {})}
            children.append(
                subprocess.Popen(words, cwd=tmp_path, env=sourced_env, stdout=log, stderr=log)
            )
            if index == 0:
                assert wait_for_port(port, timeout_s=60)
        assert children[0].wait(timeout=180) == 0, (tmp_path / "fleet-0.log").read_text()
        for child in children[1:]:
            child.send_signal(signal.SIGINT)
            child.wait(timeout=30)
        (exported,) = [
            subprocess.run(w, cwd=tmp_path, env=env, capture_output=True, timeout=120)
            for w in export
        ]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
        for log in logs:
            log.close()

    # Assert
    keys = next(v for k, v in printed.items() if "state_dict" in k)
    assert "['0.weight', '0.bias', '2.weight', '2.bias']" in keys  # what the guide says it prints
    assert (tmp_path / "runs" / "iris" / "summary.json").is_file()
    assert (tmp_path / "data" / "dev-1" / "train.npz").is_file()
    assert (tmp_path / "runs" / "iris-fleet" / "summary.json").is_file()
    assert exported.returncode == 0, exported.stdout.decode() + exported.stderr.decode()
    graph = onnx.load(str(tmp_path / "dev-0.onnx")).graph
    assert [i.name for i in graph.input] == ["inputs"]


def test_the_guide_is_linked_from_the_readme_and_the_quickstart() -> None:
    assert "docs/own-task.md" in (REPO / "README.md").read_text()
    assert "own-task.md" in (REPO / "docs" / "quickstart.md").read_text()


@pytest.mark.slow
def test_the_cnn_example_simulates_and_exports(tmp_path, monkeypatch) -> None:
    # Prepare
    monkeypatch.chdir(REPO)
    out, exports = tmp_path / "run", tmp_path / "onnx"

    # Execute
    result = CliRunner().invoke(
        coord_app,
        [
            *shlex.split("simulate --task examples.cnn_digits:task --algorithm fedalt --devices 4"),
            *["--rounds", "3", "--out", str(out), "--export-dir", str(exports)],
        ],
    )

    # Assert
    assert result.exit_code == 0, result.output
    models = sorted(exports.glob("*.onnx"))
    assert len(models) == 4
    assert [i.name for i in onnx.load(str(models[0])).graph.input] == ["images"]
