"""The CLI's import path leaves feature-only packages unloaded (they load where a feature runs).

Checked in a fresh interpreter through `sys.modules`, so that nothing this test session already
imported counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.startup import FEATURE_ONLY, loaded_after_import


def test_the_probe_sees_a_package_that_was_imported() -> None:
    assert loaded_after_import("import dp_accounting", ("dp_accounting",)) == ["dp_accounting"]


@pytest.mark.parametrize("module", ["coordinator.cli.app", "coordinator.run.simulate"])
def test_importing_the_cli_loads_no_feature_only_package(module: str) -> None:
    assert loaded_after_import(f"import {module}", FEATURE_ONLY) == []


def test_a_dp_accounting_call_still_loads_the_library() -> None:
    code = (
        "import json, sys\n"
        "from coordinator.stages.accountant import DpRound, epsilons_of\n"
        "e = epsilons_of([DpRound(1.0, 100, 10.0)], 'poisson', 1e-5)\n"
        "print(json.dumps([e.rdp, 'dp_accounting' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rdp, loaded = json.loads(out.stdout)
    assert loaded
    assert 0 < rdp < 10


def test_a_simulation_without_export_or_broker_loads_neither() -> None:
    statement = (
        "from coordinator.run.settings import SimulationSettings\n"
        "from coordinator.run.simulate import run_simulation\n"
        "run_simulation(SimulationSettings.load(None, task='digits', devices=3, rounds=1))"
    )
    loaded = loaded_after_import(statement, ("onnx", "onnxruntime", "amqtt", "sklearn"))
    assert loaded == ["sklearn"]  # the digits data; the probe sees what the run imported
