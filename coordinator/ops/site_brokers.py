"""Sites for an aggregator tier: a mosquitto per site, bridged to the fleet's core broker.

Each site's broker holds its devices' accounts and its aggregator's (`pfl-aggregator-<site>`, whose
partial aggregates travel as `pfl/<fleet>/tier/<site>/partial`). Its bridge carries, from the core
to the site, what devices and the aggregator read (the round, the model, commands, the
coordinator's status, the fleet status's summary but not its per-device rows, the tier's plan and
close); from the site to the core, what the coordinator reads of devices (hellos, statuses,
evaluations, export reports, peer requests) and the site's partial aggregates. Device updates are
not bridged: they stay at the site, where the aggregator reads them. On the core broker the bridge
logs in as `pfl-bridge-<site>`, whose ACL lets it write only its own devices' topics and its own
aggregator's partials.

A site without its own ports is on the core broker (one broker, no bridge): its aggregator's
account is made there and reads its devices' updates on the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.tier import wire
from protocols import access, topics
from protocols.access import Grant

BRIDGED_DEVICE_KINDS: tuple[topics.DeviceTopicKind, ...] = (
    "hello",
    "status",
    "evaluation",
    "export-report",
    "request",
)
"""What the coordinator reads of a site's devices; never `update` nor `secagg`."""


@dataclass(frozen=True)
class Site:
    """A site: its devices, and its broker's ports (None: the site is on the core broker)."""

    name: str
    devices: tuple[str, ...]
    tls_port: int | None = None
    plain_port: int | None = None
    """A plain listener on 127.0.0.1 beside the TLS one (None: none)."""

    @property
    def bridged(self) -> bool:
        """Whether the site has its own broker, bridged to the core."""
        return self.tls_port is not None

    @property
    def aggregator_user(self) -> str:
        """The site aggregator's account (its broker client id too)."""
        return f"pfl-aggregator-{self.name}"

    @property
    def bridge_user(self) -> str:
        """The bridge's account on the core broker."""
        return f"pfl-bridge-{self.name}"


def parse_site(text: str) -> Site:
    """`name[:tls_port[:plain_port]]=dev-1,dev-2` (the `--site` option of provision).

    Raises:
        ValueError: not of that form.
    """
    head, sep, listed = text.partition("=")
    parts = head.split(":")
    devices = tuple(d.strip() for d in listed.split(",") if d.strip())
    if not sep or not devices or not parts[0] or len(parts) > 3:
        msg = f"--site {text!r}: give name[:tls_port[:plain_port]]=device,device,..."
        raise ValueError(msg)
    try:
        ports = [int(port) for port in parts[1:]]
    except ValueError:
        msg = f"--site {text!r}: ports are numbers"
        raise ValueError(msg) from None
    tls_port = ports[0] if ports else None
    plain_port = ports[1] if len(ports) > 1 else None
    return Site(parts[0], devices, tls_port, plain_port)


def _downlink(fleet: str, site: Site) -> list[str]:
    """Topic filters the core sends a site (with their chunk topics: by `#`, or named)."""
    root = f"{topics.ROOT}/{fleet}"
    del site
    return [
        f"{root}/round/#",
        f"{root}/model/#",
        f"{root}/model-delta/#",
        f"{root}/command/#",
        f"{root}/relay/#",
        f"{root}/coordinator/status/#",
        topics.fleet_status(fleet),  # the summary devices read; rows stay at the core
        topics.chunk_subscription(topics.fleet_status(fleet)),
        f"{wire.plan_topic(fleet)}/#",
        f"{wire.close_topic(fleet)}/#",
    ]


def _uplink(fleet: str, site: Site, devices: Sequence[str] | None) -> list[str]:
    """Topic filters a site sends the core: its devices' (all with None), its partials, status."""
    ids = ["+"] if devices is None else list(devices)
    root = f"{topics.ROOT}/{fleet}/device"
    return [
        *(f"{root}/{d}/{kind}/#" for d in ids for kind in BRIDGED_DEVICE_KINDS),
        f"{wire.partial_topic(fleet, site.name)}/#",
        f"{wire.status_topic(fleet, site.name)}/#",
    ]


def bridge_lines(
    fleet: str, site: Site, core_host: str, core_port: int, password: str, ca_file: Path
) -> list[str]:
    """The site broker's bridge to the core (TLS, the bridge's own account)."""
    return [
        "",
        "# The bridge to the core broker: what crosses it, and which way.",
        f"connection {site.bridge_user}",
        f"address {core_host}:{core_port}",
        f"remote_clientid {site.bridge_user}",
        f"remote_username {site.bridge_user}",
        f"remote_password {password}",
        f"bridge_cafile {ca_file}",
        "cleansession true",
        "notifications false",
        "try_private true",
        *(f"topic {pattern} in 1" for pattern in _downlink(fleet, site)),
        *(f"topic {pattern} out 1" for pattern in _uplink(fleet, site, None)),
    ]


def bridge_grants(fleet: str, site: Site) -> tuple[Grant, ...]:
    """The bridge account on the core: read the downlink, write its own devices and partials."""
    return (
        *(Grant("read", pattern) for pattern in _downlink(fleet, site)),
        *(Grant("write", pattern) for pattern in _uplink(fleet, site, site.devices)),
    )


def aggregator_grants(fleet: str, site: Site) -> tuple[Grant, ...]:
    """The site aggregator: read rounds, plans and device messages; write partials, secure topics.

    The secure topics are its devices' own, for secure aggregation within its group.
    """
    reads = [
        topics.round_announcement(fleet),
        wire.plan_topic(fleet),
        wire.close_topic(fleet),
        *(topics.device_subscription(fleet, kind) for kind in ("status", "update", "secagg")),
    ]
    writes = [wire.partial_topic(fleet, site.name), wire.status_topic(fleet, site.name)]
    writes += [topics.secure(fleet, d) for d in site.devices]  # secure aggregation in the group
    return (
        *(Grant("read", pattern) for topic in reads for pattern in (topic, f"{topic}/#")),
        *(Grant("write", pattern) for topic in writes for pattern in (topic, f"{topic}/#")),
    )


def site_acl(fleet: str, site: Site, max_chunks: int) -> str:
    """A site broker's ACL: its devices (as on the core) and its aggregator."""
    lines = [
        f"# Generated by `pfl-coord provision`: site {site.name}. Anything not granted is denied.",
        "",
        *access.acl_lines(site.aggregator_user, aggregator_grants(fleet, site)),
    ]
    for device_id in site.devices:
        grants = access.device_grants(fleet, device_id, max_chunks)
        lines += ["", *access.acl_lines(device_id, grants)]
    return "\n".join(lines) + "\n"


def core_acl_lines(fleet: str, sites: Sequence[Site]) -> list[str]:
    """What the core's ACL adds: each bridge's account, each core-side aggregator's."""
    lines: list[str] = []
    for site in sites:
        if site.bridged:
            lines += ["", *access.acl_lines(site.bridge_user, bridge_grants(fleet, site))]
        else:
            lines += ["", *access.acl_lines(site.aggregator_user, aggregator_grants(fleet, site))]
    return lines
