"""pfl-edge works from a user's project folder holding its own `tasks.py` and `export.py`.

Both names are common (invoke's convention); with the folder first on `sys.path` (`python -m`,
`python -c`) they must neither shadow our packages nor be shadowed by them, and a user task given
as `tasks:Attribute` is found there, by `python -m` and by the installed `pfl-coord` alike.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, child_env

pytestmark = [pytest.mark.timeout(180)]

TASKS_PY = """
from pfl_tasks.sine import SineTask


class MySine(SineTask):
    name = "my-sine"
"""
EXPORT_PY = 'WHO = "the user"\n'


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text(TASKS_PY)
    (tmp_path / "export.py").write_text(EXPORT_PY)
    return tmp_path


def _run(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env["PYTHONPATH"] = str(REPO)  # the repository, as an installed package would be
    return subprocess.run(
        argv, cwd=folder, env=env, capture_output=True, text=True, timeout=150, check=False
    )


def _simulate(folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`pfl-coord simulate FLAGS`, run as a module from `folder`."""
    return _run(folder, sys.executable, "-m", "coordinator.cli.app", "simulate", *flags)


def test_our_packages_and_the_users_modules_import_side_by_side(project: Path) -> None:
    code = (
        "import device_agent.agent, coordinator.cli.app, device_agent.exporting as ex\n"
        "import export, tasks\n"
        "assert export.WHO == 'the user', export\n"
        "ours = ex._export_package()  # loaded at the first export, as an agent's export does\n"
        "assert ours.__file__.startswith({!r}), ours.__file__\n"
        "assert tasks.MySine.name == 'my-sine'\n"
    ).format(str(REPO / "export"))
    result = _run(project, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr


def test_simulate_runs_the_users_task_and_exports_from_their_folder(project: Path) -> None:
    result = _simulate(
        project, "--task", "tasks:MySine", "--devices", "3", "--rounds", "1",
        "--out", "run", "--export-dir", "onnx",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (project / "onnx").glob("*.onnx")) == [
        "dev-0000.onnx",
        "dev-0001.onnx",
        "dev-0002.onnx",
    ]
    assert (project / "run" / "summary.json").exists()


def test_the_installed_command_finds_a_task_in_the_working_directory(project: Path) -> None:
    script = Path(sys.executable).with_name("pfl-coord")
    assert script.exists(), f"{script}: install the project (pip install -e .) first"
    result = _run(
        project,
        str(script),
        "simulate",
        "--task",
        "tasks:MySine",
        "--devices",
        "2",
        "--rounds",
        "1",
        "--out",
        "run",
    )
    assert result.returncode == 0, result.stderr
    assert "my-sine" in (project / "run" / "summary.json").read_text()


def test_a_task_module_found_nowhere_names_the_folder_searched(project: Path) -> None:
    result = _simulate(project, "--task", "nowhere:Task", "--rounds", "1")
    assert result.returncode != 0
    assert "nowhere" in result.stdout + result.stderr
    assert str(project) in (result.stdout + result.stderr).replace("\n", "")
