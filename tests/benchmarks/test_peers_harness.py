"""benchmarks/peers_harness.py: the peer comparison's command, on a tiny workload, bare loop only.

The peers (Flower, Apple's pfl) are optional and never installed here: a peer asked for without
its environment is a row saying why, and the runners a peer's environment runs must not need
pfl-edge.
"""

from __future__ import annotations

import ast
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.peers import common
from benchmarks.peers_harness import MARKER, Runner, layers_of, main, measure, write_workload
from benchmarks.peers_venvs import ROOT
from pfl_tasks.registry import load_task

TINY = ["--workloads", "digits-mlp", "--devices", "3", "--rounds", "2"]


def test_command_writes_the_table_with_versions_and_both_timings(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nkept by hand\n")
    venvs = tmp_path / "venvs"

    main(
        [
            *TINY,
            *("--runners", "bare,flower", "--repeats", "2", "--no-install"),
            *("--venvs", str(venvs), "--out", str(out)),
        ]
    )

    text = out.read_text()
    assert "kept by hand" in text
    assert text.count(MARKER) == 2
    table = text.split("**digits MLP, 3 devices, 2 rounds**")[1]
    bare = next(line for line in table.splitlines() if line.startswith("| bare PyTorch loop"))
    cells = [cell.strip() for cell in bare.strip("|").split("|")]
    assert cells[1] == f"torch {torch.__version__}"
    in_run, whole = float(cells[2]), float(cells[4])
    assert 0 < in_run < whole  # the process holds the run, its imports and data besides
    assert cells[3] == cells[5] == "1.00x"  # the reference
    assert 0.0 <= float(cells[6]) <= 1.0
    assert cells[7] == "2"
    assert "Reference: bare PyTorch loop." in table
    flower = next(line for line in table.splitlines() if line.startswith("| Flower"))
    assert f"failed: no virtual environment for flower at {venvs / 'flower'}" in flower
    assert "python -m benchmarks.peers --workloads digits-mlp --devices 3" in text


def test_a_runner_that_fails_is_a_row_with_its_error(tmp_path: Path) -> None:
    directory = tmp_path / "workload"
    write_workload(directory, {"task": "digits", "algorithm": "fedavg", "devices": 2, "rounds": 1})
    broken = {"broken": Runner("broken", "benchmarks.peers.no_such_runner")}

    timings = measure(directory, broken, {"broken": Path(sys.executable)}, 2, 1, 60.0)

    assert timings["broken"].failure is not None
    assert "exit status 1" in timings["broken"].failure
    assert "no_such_runner" in timings["broken"].failure
    assert timings["broken"].in_run_s == []


def test_a_run_out_of_time_is_stopped_and_reported(tmp_path: Path) -> None:
    directory = tmp_path / "workload"
    write_workload(directory, {"task": "digits", "algorithm": "fedavg", "devices": 2, "rounds": 1})
    bare = {"bare": Runner("bare", "benchmarks.peers.bare")}

    # starting python and importing torch alone takes longer than this
    timings = measure(directory, bare, {"bare": Path(sys.executable)}, 2, 1, 0.05)

    assert timings["bare"].failure == "did not finish within 0.05 s"
    assert timings["bare"].in_run_s == []
    assert not list(directory.glob("result-*.json"))


def test_the_standalone_cnn_computes_what_the_tasks_cnn_computes(tmp_path: Path) -> None:
    simulation = {"task": "mnist1d", "algorithm": "fedavg", "devices": 3, "rounds": 1}
    workload = write_workload(tmp_path, simulation)
    task_model = load_task("mnist1d").build_model(0)
    signals = workload.devices[1].test_x
    with torch.no_grad():
        assert torch.equal(workload.build_model()(signals), task_model(signals))
    assert [kind for kind, _, _ in workload.layers].count("GroupNorm") == 3


def test_a_model_the_peers_cannot_build_is_refused() -> None:
    model = nn.Sequential(OrderedDict(input=nn.GRU(1, 4), output=nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="'input' \\(GRU\\) is not one the peers can build"):
        layers_of(model)


def test_each_device_and_round_has_its_own_order_and_every_runner_the_same() -> None:
    first = common.epoch_orders(30, 0, 1, 2)
    assert torch.equal(first[0], common.epoch_orders(30, 0, 1, 2)[0])
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], common.epoch_orders(30, 1, 1, 1)[0])
    assert not torch.equal(first[0], common.epoch_orders(30, 0, 2, 1)[0])


PROJECT = ("coordinator", "device_agent", "protocols", "pfl_tasks", "export", "benchmarks")


@pytest.mark.parametrize("runner", ["common", "bare", "flower", "apple_pfl"])
def test_a_peers_runner_imports_nothing_of_pfl_edge(runner: str) -> None:
    tree = ast.parse((ROOT / "benchmarks" / "peers" / f"{runner}.py").read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    ours = [name for name in imported if name and name.split(".")[0] in PROJECT]
    assert set(ours) <= {"benchmarks.peers"}, ours
