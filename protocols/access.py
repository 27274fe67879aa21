"""Who may publish and read which topics: one rule set for mosquitto's ACL and the embedded broker.

A device may write only a fixed, finite set of topic names: its own device topics, and chunk
topics with an index below a limit for the kinds whose payloads can exceed one message. A broker
cannot refuse the retain flag per topic, so this is what bounds the retained messages one device
can leave on it: at most `len(writable topics)` of them, each at most the broker's packet size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from protocols import topics
from protocols.transport.chunking import HEADER

COORDINATOR_USER: Final = "pfl-coordinator"
OPERATOR_USER: Final = "pfl-operator"
"""The account of `pfl-coord export`: sends commands, reads statuses and export reports."""
VIEWER_USER: Final = "pfl-viewer"
"""The account of `pfl-coord status`: reads the fleet's retained statuses, writes nothing."""
DASHBOARD_USER: Final = "pfl-dashboard"
"""The account of `pfl-coord dashboard`: reads what the viewer reads, writes nothing."""
TOOL_USERS: Final = (OPERATOR_USER, VIEWER_USER, DASHBOARD_USER)
"""One account per operator tool: a broker that binds client ids to user names (mosquitto's
`use_username_as_clientid`) drops an older session for a newcomer of the same name, so tools
sharing one account would knock each other off."""
CHUNKED_DEVICE_KINDS: Final[tuple[topics.DeviceTopicKind, ...]] = ("update", "secagg")
"""The device messages that can outgrow one MQTT message (deltas, masked vectors, shares)."""
DEFAULT_MAX_UPLOAD_BYTES: Final = 16 * 1024 * 1024
"""The largest update (or secure-aggregation message) a device may send, chunked."""

Access = Literal["read", "write", "readwrite"]


@dataclass(frozen=True)
class Grant:
    """One ACL line: `access` to the topics `pattern` matches."""

    access: Access
    pattern: str


def chunk_limit(max_upload_bytes: int, chunk_size_bytes: int) -> int:
    """How many chunks a payload of `max_upload_bytes` takes (its highest index + 1)."""
    return max(1, math.ceil(max_upload_bytes / (chunk_size_bytes - HEADER.size)))


def coordinator_grants(fleet: str) -> tuple[Grant, ...]:
    """The coordinator owns the whole fleet subtree."""
    return (Grant("readwrite", topics.fleet_subtree(fleet)),)


def operator_grants(fleet: str) -> tuple[Grant, ...]:
    """Commands out; statuses, history and export reports in; never updates, models or relays."""
    reads = [topics.operator_readable(fleet)]
    return (Grant("write", topics.command_subscription(fleet)), *_reads(*reads))


def viewer_grants(fleet: str) -> tuple[Grant, ...]:
    """Statuses and the run's history in; nothing out (no command, no model, no round)."""
    reads = [
        topics.coordinator_status(fleet),
        topics.fleet_status(fleet),
        topics.fleet_row(fleet),
        topics.run_history(fleet),
        topics.device_subscription(fleet, "status"),
        topics.aggregator_status(fleet),
    ]
    return _reads(reads)


def tool_grants(user: str, fleet: str) -> tuple[Grant, ...]:
    """What the operator tool logging in as `user` (one of TOOL_USERS) may do.

    Raises:
        KeyError: `user` is no tool's account.
    """
    return {
        OPERATOR_USER: operator_grants,
        VIEWER_USER: viewer_grants,
        DASHBOARD_USER: viewer_grants,
    }[user](fleet)


def device_grants(fleet: str, device_id: str, max_chunks: int) -> tuple[Grant, ...]:
    """A device writes (and reads) its own topics and `max_chunks` chunks of the large ones.

    Raises:
        ProtocolError: `device_id` cannot name a device.
    """
    own = [topics.device(fleet, device_id, kind) for kind in topics.DEVICE_TOPIC_KINDS]
    writes = list(own)
    for kind in CHUNKED_DEVICE_KINDS:
        base = topics.device(fleet, device_id, kind)
        writes += [topics.chunk_topic(base, index) for index in range(max_chunks)]
    return (
        *(Grant("write", topic) for topic in writes),
        *_reads(own, topics.device_readable(fleet, device_id)),  # its own: e.g. its status
    )


def allows(grants: Sequence[Grant], topic: str, *, write: bool) -> bool:
    """Whether `grants` let a client write (or read/subscribe) `topic`.

    A subscription filter counts as a topic name: `+` and `#` in it match only the same
    wildcards in a grant, so a device subscribing to `#` is refused, not silently narrowed.
    """
    wanted = "write" if write else "read"
    return any(
        wanted in grant.access and topics.topic_matches(grant.pattern, topic) for grant in grants
    )


def acl_lines(user: str, grants: Sequence[Grant]) -> list[str]:
    """A mosquitto ACL section for `user`."""
    return [f"user {user}", *(f"topic {grant.access} {grant.pattern}" for grant in grants)]


def _reads(*groups: Sequence[str]) -> tuple[Grant, ...]:
    """Read grants for each topic and its chunk topics (large payloads travel as chunks)."""
    return tuple(
        Grant("read", pattern)
        for group in groups
        for topic in group
        for pattern in (topic, topics.chunk_subscription(topic))
    )
