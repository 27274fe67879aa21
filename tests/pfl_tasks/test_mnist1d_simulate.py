"""`pfl-coord simulate --task mnist1d` runs with no network: the data are generated, not fetched.

Each run is a child process whose sockets may reach the loopback only (a guard installed
before the program starts), from an empty working directory, as a fresh install would run it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

OFFLINE = textwrap.dedent(
    """
    import runpy, socket, sys

    LOCAL = (None, "127.0.0.1", "::1", "localhost")
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def local_connect(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in LOCAL:
            raise OSError(f"offline test: connection to {host} refused")
        return connect(self, address)

    def local_getaddrinfo(host, *args, **kwargs):
        if host not in LOCAL:
            raise OSError(f"offline test: lookup of {host} refused")
        return getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = local_connect
    socket.getaddrinfo = local_getaddrinfo
    if sys.argv[1] == "--probe":
        import urllib.request
        urllib.request.urlopen("https://github.com/greydanus/mnist1d", timeout=5)
    else:
        sys.argv[0] = "pfl-coord"
        runpy.run_module("coordinator.cli.app", run_name="__main__", alter_sys=True)
    """
)


def _offline(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    (folder / "offline.py").write_text(OFFLINE)
    return subprocess.run(
        [sys.executable, str(folder / "offline.py"), *argv],
        cwd=folder,
        env={**child_env(), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )


def test_the_guard_refuses_the_network(tmp_path: Path) -> None:
    probe = _offline(tmp_path, "--probe")
    assert probe.returncode != 0
    assert "offline test: lookup of github.com refused" in probe.stderr


def test_two_rounds_of_the_cnn_run_offline_from_an_empty_folder(tmp_path: Path) -> None:
    # Execute: the command docs/tasks.md shows, with fewer devices
    done = _offline(
        tmp_path,
        *shlex.split(
            "simulate --task mnist1d --devices 3 --rounds 2 --partition iid --out runs/cnn"
        ),
    )

    # Assert: two rounds on the CNN; nothing cached or downloaded next to the run
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "runs" / "cnn" / "summary.json").read_text())
    assert summary["task"] == "mnist1d"
    assert summary["rounds"] == 2
    assert summary["metrics"]["personalized_mean"] > 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offline.py", "runs"]


def test_the_gru_under_feature_shift_runs_from_a_config_file(tmp_path: Path) -> None:
    # Prepare: the config docs/tasks.md shows
    (tmp_path / "gru.toml").write_text(
        'task = "mnist1d"\n\n[task_options]\nmodel = "gru"\nshift = "feature"\n'
    )

    # Execute
    done = _offline(
        tmp_path,
        *shlex.split("simulate --config gru.toml --algorithm fedalt --devices 3 --rounds 2"),
        *shlex.split("--partition iid --out runs/gru"),
    )

    # Assert
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "runs" / "gru" / "summary.json").read_text())
    assert summary["task"] == "mnist1d"
    assert summary["algorithm"] == "fedalt"
    assert summary["rounds"] == 2


def test_the_batchnorm_cnn_is_chosen_with_the_model_flag_and_trains_as_fedbn(
    tmp_path: Path,
) -> None:
    # Execute: the command docs/tasks.md shows, with fewer devices
    done = _offline(
        tmp_path,
        *shlex.split("simulate --task mnist1d --model cnn-bn --personal-preset fedbn"),
        *shlex.split("--devices 3 --rounds 2 --partition iid --out runs/bn"),
    )

    # Assert: the run recorded the model as the task option a config table would give
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = json.loads((tmp_path / "runs" / "bn" / "run.json").read_text())
    assert (recorded["model"], recorded["task_options"]) == ("cnn-bn", {"model": "cnn-bn"})
    summary = json.loads((tmp_path / "runs" / "bn" / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert summary["config"]["personal_preset"] == "fedbn"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--task mnist1d --model lstm", "valid models: cnn, cnn-bn, cnn-paper, gru, mlp, linear"),
        ("--task sine --model cnn", "task 'sine' offers no choice of model"),
    ],
)
def test_the_model_flag_refuses_what_the_task_does_not_offer(
    tmp_path: Path, argv: str, message: str
) -> None:
    done = _offline(tmp_path, "simulate", *shlex.split(argv), "--rounds", "1")
    assert done.returncode != 0
    assert message in " ".join((done.stdout + done.stderr).split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offline.py"]
