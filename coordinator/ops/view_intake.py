"""What an operator view accepts: on each topic only the message kind that topic may carry.

`pfl-coord status` and the dashboard (fed by the broker or by `serve` in-process) read every
message through `view_message`. A device may publish on its own subtree only, so a device's
status topic carries that device's own `DeviceStatus` and nothing else; the coordinator's status,
fleet summary, fleet rows and run history count only from the coordinator's own topics (a row
only for the device its topic names). A timestamp must be a real time no further ahead than the
clock skew allows, so nothing can pin "last seen" or print as `Infinity`.
"""

from __future__ import annotations

import math
from typing import Final

from protocols import topics
from protocols.codec import decode_frame
from protocols.errors import ProtocolError
from protocols.messages import (
    CoordinatorStatus,
    DeviceStatus,
    FleetRow,
    FleetStatus,
    FleetSummary,
    Message,
    RunHistory,
)

VIEW_KINDS: Final[dict[str, type[Message]]] = {
    "coordinator-status": CoordinatorStatus,
    "fleet-status": FleetSummary,
    "fleet-row": FleetRow,
    "run-history": RunHistory,
    "status": DeviceStatus,
}
"""Topic kind (as `topics.parse_topic` names it) -> the one message kind it may carry."""
MAX_CLOCK_SKEW_S: Final = 300.0
"""How far ahead of this machine's clock a sender's timestamp may be."""


def view_topic(fleet: str, topic: str) -> topics.TopicRef | None:
    """The parsed topic when it is one of `fleet`'s view topics, else None (nothing decoded)."""
    try:
        ref = topics.parse_topic(topic)
    except ProtocolError:
        return None
    return ref if ref.fleet == fleet and ref.kind in VIEW_KINDS else None


def view_message(fleet: str, topic: str, payload: bytes, now: float) -> Message:
    """The message on `topic`, when it is exactly what that topic of `fleet` may carry.

    Raises:
        ProtocolError: not a view topic of `fleet`, a malformed frame, another message kind than
            the topic's, another device's or fleet's message, or a timestamp that is not finite
            or lies in the future.
    """
    ref = view_topic(fleet, topic)
    if ref is None:
        msg = f"not a status topic of fleet {fleet!r}"
        raise ProtocolError(msg, topic=topic)
    message, _ = decode_frame(payload)
    expected = VIEW_KINDS[ref.kind]
    if not isinstance(message, expected):
        msg = f"a {type(message).__name__} on a topic that carries only {expected.__name__}"
        raise ProtocolError(msg, topic=topic)
    if isinstance(message, DeviceStatus) and message.device_id != ref.device_id:
        msg = f"a status of {message.device_id!r} on the status topic of {ref.device_id!r}"
        raise ProtocolError(msg, topic=topic)
    if isinstance(message, FleetRow) and message.device.device_id != ref.device_id:
        msg = f"the row of {message.device.device_id!r} on the row topic of {ref.device_id!r}"
        raise ProtocolError(msg, topic=topic)
    if isinstance(message, CoordinatorStatus | FleetSummary | FleetRow | RunHistory) and (
        message.fleet != fleet
    ):
        msg = f"a message of fleet {message.fleet!r} on a topic of fleet {fleet!r}"
        raise ProtocolError(msg, topic=topic)
    check_view_message(message, now)
    return message


def check_view_message(message: Message, now: float) -> None:
    """Every time in `message` finite and not ahead of `now` (beyond MAX_CLOCK_SKEW_S).

    The other numbers of the view kinds are bounded by the wire contract already; `sent_at` and
    a fleet status's `last_seen` are not.

    Raises:
        ProtocolError: a time that is negative, not finite, or beyond now plus the skew.
    """
    times = [("sent_at", message.sent_at)]
    if isinstance(message, FleetStatus):
        times += [(f"last_seen of {d.device_id}", d.last_seen) for d in message.devices]
    if isinstance(message, FleetRow):
        times.append((f"last_seen of {message.device.device_id}", message.device.last_seen))
    for name, value in times:
        if not math.isfinite(value) or value < 0 or value > now + MAX_CLOCK_SKEW_S:
            msg = f"{name} {value!r} is not a time up to now (at most {MAX_CLOCK_SKEW_S:g} s ahead)"
            raise ProtocolError(msg)
