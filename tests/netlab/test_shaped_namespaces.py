"""A device process in its own network namespace, its veth link shaped by tbf, over mosquitto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto, free_port
from tests.netlab.namespaces import ShapedNamespace, unavailable

pytestmark = pytest.mark.mosquitto

ROOT = Path(__file__).resolve().parents[2]
UP_KBIT = 1000
PAYLOAD = 400_000
_DEVICE = """
import sys, time
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
with MqttTransport(BrokerSettings(url=sys.argv[1], chunk_size_bytes=64 * 1024), "ns-device") as t:
    started = time.monotonic()
    t.publish("pfl/f/device/ns-device/update", bytes(range(256)) * (int(sys.argv[2]) // 256))
    assert t.flush(120)
    print(time.monotonic() - started)
"""


def test_an_upload_from_a_namespace_is_capped_by_its_shaped_link(
    mosquitto_factory, tmp_path
) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}; the proxy profiles still run")
    with ShapedNamespace(slot=7, up_kbit=UP_KBIT, down_kbit=4 * UP_KBIT) as namespace:
        port = free_port()
        broker: Mosquitto = mosquitto_factory(f"listener {port} {namespace.host_address}\n")
        received: list[bytes] = []
        with MqttTransport(BrokerSettings(url=broker.url), "coordinator") as coordinator:
            coordinator.subscribe(
                "pfl/f/device/ns-device/update", lambda _topic, data: received.append(data)
            )
            url = f"mqtt://{namespace.host_address}:{port}"
            device = subprocess.run(
                namespace.command([sys.executable, "-c", _DEVICE, url, str(PAYLOAD)]),
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                check=False,
            )
            assert device.returncode == 0, device.stderr
            assert coordinator.wait_until(lambda: bool(received), 120)
    assert received == [bytes(range(256)) * (PAYLOAD // 256)]
    seconds = float(device.stdout.strip().splitlines()[-1])
    assert seconds >= 0.8 * PAYLOAD * 8 / (UP_KBIT * 1000)  # no faster than the link allows
