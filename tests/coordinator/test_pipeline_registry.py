"""The coordinator a run builds gets a registry that keeps losses only where they may be shown."""

from __future__ import annotations

from typing import Any

import pytest

from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_coordinator


@pytest.mark.parametrize(
    ("run", "keeps"),
    [({}, True), ({"dp_noise": 1.0}, False), ({"secagg": True}, False)],
    ids=["plain", "dp", "secagg"],
)
def test_the_registry_is_built_keeping_losses_only_without_dp_or_secagg(
    run: dict[str, Any], keeps: bool
) -> None:
    coordinator = hub_coordinator(InProcessBroker(), "fedavg", devices=3, rounds=1, run=run)
    try:
        assert coordinator.registry.keeps_losses is keeps
    finally:
        coordinator.transport.close()
