"""provision --site: site brokers bridged to the core, with the tier's accounts."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.ops.provision import ProvisionError, provision
from coordinator.ops.site_brokers import Site, parse_site
from coordinator.tier.settings import AggregatorSettings


def test_a_site_with_ports_gets_a_broker_bridged_to_the_core(tmp_path: Path) -> None:
    # Execute
    result = provision(
        ["core-1"],
        tmp_path / "out",
        fleet="f",
        host="10.0.0.1",
        tls_port=8883,
        sites=[Site("north", ("n-1", "n-2"), 9883), Site("here", ("h-1",))],
        use_mosquitto_passwd=False,
    )
    # Assert: the site's devices log in at the site, and only the site's own traffic crosses
    north = result.sites["north"]
    assert north.broker_url == "mqtts://10.0.0.1:9883"
    assert "PFL_BROKER=mqtts://10.0.0.1:9883" in (tmp_path / "out/devices/n-1.env").read_text()
    assert "PFL_BROKER=mqtts://10.0.0.1:8883" in (tmp_path / "out/devices/h-1.env").read_text()
    conf = north.files["mosquitto.conf"].read_text()
    assert "connection pfl-bridge-north\naddress 10.0.0.1:8883\n" in conf
    assert f"remote_password {north.bridge.password}\n" in conf  # type: ignore[union-attr]
    assert "topic pfl/f/round/# in 1" in conf
    assert "topic pfl/f/tier/north/partial/# out 1" in conf
    assert "topic pfl/f/device/+/hello/# out 1" in conf
    assert "update" not in "".join(line for line in conf.splitlines() if line.startswith("topic"))
    # the fleet status's summary (and its chunks) reach the site; its per-device rows do not
    assert "topic pfl/f/coordinator/fleet in 1" in conf
    assert "topic pfl/f/coordinator/fleet/chunk/+ in 1" in conf
    assert "topic pfl/f/coordinator/fleet/# in 1" not in conf
    assert north.files["mosquitto.conf"].stat().st_mode & 0o777 == 0o600
    site_users = (tmp_path / "out/sites/north/passwords").read_text()
    assert {line.split(":")[0] for line in site_users.splitlines()} == {
        "pfl-aggregator-north",
        "n-1",
        "n-2",
    }
    core_users = {line.split(":")[0] for line in result.files["passwords"].read_text().splitlines()}
    assert {"core-1", "h-1", "pfl-bridge-north", "pfl-aggregator-here"} <= core_users
    assert not {"n-1", "pfl-aggregator-north"} & core_users
    core_acl = result.files["acl"].read_text()
    assert "user pfl-bridge-north\n" in core_acl
    assert "topic write pfl/f/device/n-1/hello/#" in core_acl
    assert "topic write pfl/f/device/+/hello/#" not in core_acl  # only its own devices
    settings = AggregatorSettings.load(north.files["aggregator.toml"])
    assert (settings.name, settings.devices, settings.username) == (
        "north",
        ["n-1", "n-2"],
        "pfl-aggregator-north",
    )
    assert settings.problem() is None


def test_sites_are_refused_when_they_overlap(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError, match="each device in one site only"):
        provision(
            [],
            tmp_path / "out",
            sites=[Site("a", ("d-1",)), Site("b", ("d-1",))],
            use_mosquitto_passwd=False,
        )


def test_the_site_option_parses_names_ports_and_devices() -> None:
    assert parse_site("a:9883:1884=d-1, d-2") == Site("a", ("d-1", "d-2"), 9883, 1884)
    assert parse_site("b=d-3") == Site("b", ("d-3",))
    for bad in ("a", "a:x=d-1", "=d-1", "a:1:2:3=d"):
        with pytest.raises(ValueError, match="--site"):
            parse_site(bad)
