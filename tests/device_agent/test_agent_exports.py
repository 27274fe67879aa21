"""An agent's exports: a collaborator that reads the agent's latest round, or kept frames."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_agent.received import load_received
from device_agent.state_store import DiskStateStore
from protocols.errors import StateError
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents, hub_coordinator


def test_exports_follow_the_live_agent_and_kept_frames_feed_an_offline_one(
    tmp_path: Path,
) -> None:
    # Prepare: two devices that keep their frames on disk, as `pfl-agent start` does
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", devices=2, rounds=2)
    stores = [DiskStateStore(tmp_path / f"dev-{i}") for i in range(2)]
    live, _ = hub_agents(broker, ["dev-0", "dev-1"], lambda i: {"store": stores[i]})
    coordinator.start()
    coordinator.wait_for_devices(2, timeout_s=5)
    with pytest.raises(StateError, match="no round seen yet"):
        live.exports.context()
    before = live.exports.latest_round_id()

    # Execute
    coordinator.run_round()
    after_one = live.exports.latest_round_id()
    coordinator.run_round()
    after_two = live.exports.source().latest_round_id
    kept = load_received(stores[0].directory)
    offline = hub_agents(InProcessBroker(), ["dev-0"], lambda i: {"store": stores[0]})[0]
    offline.exports.load_received(kept.model_frame, kept.announcement, kept.relayed)

    # Assert: the live exports saw every round; the offline ones read the frames, not the agent
    assert (before, after_one, after_two) == (0, 1, 2)
    assert offline.exports.latest_round_id() == after_two
    assert offline.exports.context()[0] == live.exports.context()[0]
    assert offline.last_announcement is None
