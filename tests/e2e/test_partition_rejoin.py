"""A device cut off by a network partition mid-run rejoins and its update counts exactly once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from coordinator.engine.rounds import RoundRecord
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.virtual_fleet import device_name
from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes, wait_for
from tests.netlab.proxy import FaultProxy, PartitionMode

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]

DEVICES = 3
ROUNDS = 3
HEAL_AFTER_S = 3.0


def _partition_in_round_two(
    proxy: FaultProxy, mode: PartitionMode, healed: threading.Event
) -> Callable[[RoundRecord], None]:
    """An `on_round` that partitions the proxied device before round 2, healing it later."""

    def heal() -> None:
        proxy.heal()
        healed.set()

    def on_round(record: RoundRecord) -> None:
        if record.round_id == 1:
            tried = proxy.connections_refused
            proxy.partition(mode)
            # once the device tried to come back (after its reconnect delay), its last-will has
            # long reached the coordinator, which then waits for it before announcing round 2
            wait_for(lambda: proxy.connections_refused > tried, "the device retrying")
            threading.Timer(HEAL_AFTER_S, heal).start()

    return on_round


@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_a_partitioned_device_rejoins_and_counts_once(
    mosquitto: Mosquitto, processes: Processes, tmp_path, mode: PartitionMode
) -> None:
    # Prepare: three agents, the last one behind the fault proxy
    with FaultProxy(mosquitto.port) as proxy:
        for index in range(DEVICES):
            url = proxy.url if index == DEVICES - 1 else mosquitto.url
            processes.agent(url, index, shards=DEVICES)
        settings = ServeSettings.load(
            None,
            broker=mosquitto.url,
            rounds=ROUNDS,
            min_devices=DEVICES,
            round_timeout=300.0,  # the round waits for the partitioned device to come back
            checkpoint_dir=tmp_path / "checkpoint",
        )
        healed = threading.Event()

        # Execute: the proxied device loses its link as round 2 is announced; it heals later
        result = run_serve(settings, on_round=_partition_in_round_two(proxy, mode, healed))

        # Assert: the partition really cut the device off, and it came back through the proxy
        assert healed.is_set()
        assert proxy.resets >= 1
        assert proxy.connections_accepted >= 2
    # every round counted every device once: three participants each, and the model is
    # exactly the fault-free one (an update counted twice would weigh twice in the average)
    assert [(r.round_id, r.participants) for r in result.records] == [
        (round_id, DEVICES) for round_id in range(1, ROUNDS + 1)
    ]
    assert result.summary.devices == DEVICES
    fault_free = run_simulation(
        SimulationSettings.load(None, devices=DEVICES, rounds=ROUNDS, batched="off")
    )
    for name, tensor in fault_free.final_shared.items():
        assert torch.equal(result.final_shared[name], tensor), name
    assert "lost its connection" in processes.log(device_name(DEVICES - 1))
