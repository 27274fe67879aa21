"""The short soak: ten agent processes on shaped links, faults while rounds go on, no harm done."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes
from tests.netlab.profiles import CONGESTED_WIFI, LOOPBACK, LTE
from tests.netlab.soak import (
    FAULTS,
    Soak,
    SoakPlan,
    evaluations,
    fault_free,
    personal_fingerprints,
)

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow, pytest.mark.timeout(900)]

PLAN = SoakPlan(devices=10, rounds=6, links=(LTE, CONGESTED_WIFI, LOOPBACK))


def test_a_short_soak_loses_and_doubles_nothing(
    mosquitto: Mosquitto, processes: Processes, tmp_path
) -> None:
    # Execute: coordinator killed and resumed, then one fault of each kind between rounds
    report = Soak(PLAN, mosquitto, processes, tmp_path).run()

    # Assert: every kind of fault was injected
    assert report.killed_coordinator_at >= PLAN.kill_coordinator_at
    assert all(report.counts()[kind] >= 1 for kind in FAULTS), report.faults
    result = report.result
    assert result is not None
    # no round lost or repeated across the kill, every device counted once in every round
    run = result.records
    assert [r.round_id for r in run] == list(range(report.killed_coordinator_at + 1, 7))
    assert all(r.participants == PLAN.devices for r in run), [r.participants for r in run]
    # the model, every device's evaluation and personal state are those of the fault-free run
    reference = fault_free(PLAN)
    for name, tensor in reference.final_shared.items():
        assert torch.equal(result.final_shared[name], tensor), name
    assert result.summary.metrics == reference.summary.metrics
    assert evaluations(result.reports) == evaluations(reference.reports)
    assert report.state_root is not None
    prints = personal_fingerprints(report.state_root, reference.agents)
    assert len(prints) == PLAN.devices
    assert all(held == expected for held, expected in prints.values()), prints
