"""Agent processes started with --dp-strict-egress, served under distributed DP over mosquitto."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.run.serve import run_serve
from protocols.codec import decode_frame
from protocols.messages import DeviceHello, DeviceStatus, FleetRow
from tests.e2e.conftest import serve_settings
from tests.e2e.test_export import Wiretap

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]


def test_strict_agents_train_under_dp_and_release_nothing_else(
    mosquitto, processes, tmp_path: Path
) -> None:
    # Prepare: three strict agents, a wiretap on every topic
    tap = Wiretap(mosquitto.port)
    processes.fleet(mosquitto.url, 3, extra=("--dp-strict-egress",))
    settings = serve_settings(
        mosquitto.url,
        tmp_path,
        task="digits",
        algorithm="fedavg",
        rounds=2,
        dp_noise=1.0,
        dp_placement="device",
        secagg=True,
    )

    # Execute
    served = run_serve(settings)
    headers = [decode_frame(p)[0] for t, p in tap.stop() if "/chunk/" not in t and p]

    # Assert: both rounds with all three; hellos say 1 sample; no loss, no metric, no reason
    assert [r.scalars["secagg_survivors"] for r in served.records] == [3.0, 3.0]
    hellos = [h for h in headers if isinstance(h, DeviceHello)]
    assert len({h.device_id for h in hellos}) == 3
    assert all(h.num_train_samples == 1 for h in hellos)
    statuses = [h for h in headers if isinstance(h, DeviceStatus)]
    assert all(s.last_loss is None and s.detail == "" for s in statuses)
    assert sum(s.state == "skipped" for s in statuses) >= 3  # the final evaluation, declined
    assert served.reports == []
    rows = [h for h in headers if isinstance(h, FleetRow)]  # the fleet status's rows
    assert rows
    assert all(r.device.last_loss is None for r in rows)
