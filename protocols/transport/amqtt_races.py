"""Two races in amqtt 0.12 that print tracebacks during normal runs, and what avoids them.

1. amqtt loops over its subscription table with awaits inside the loop (retained messages for a
   reconnecting session, and every broadcast); another client subscribing meanwhile changes
   the table's size and the loop dies with "dictionary changed size during iteration", taking
   that client's connection down. `SnapshotTable` iterates over a copy taken when a loop starts.
2. A client that reconnects (MQTT 3.1.1's discard-then-resume, or a quick restart) may arrive
   before amqtt has handled the DISCONNECT of its previous connection; amqtt then "takes over"
   the still-connected session, warns, and may drop both. `wait_for_previous_disconnect` lets
   that DISCONNECT land first; a second client really using the same id still takes over,
   only `TAKEOVER_GRACE_S` later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Final

TAKEOVER_GRACE_S: Final = 3.0
"""How long a reconnecting client waits for its previous connection's DISCONNECT to land."""
_POLL_S: Final = 0.01


class SnapshotTable(dict[str, Any]):
    """A dict whose iteration (keys, values, items) walks a copy taken when the loop starts."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(dict.keys(self)))

    def keys(self) -> list[str]:  # type: ignore[override]
        """The keys as they are now: a list, unaffected by later changes."""
        return list(dict.keys(self))

    def values(self) -> list[Any]:  # type: ignore[override]
        """The values as they are now."""
        return list(dict.values(self))

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        """The items as they are now."""
        return list(dict.items(self))


def snapshot_subscriptions(broker: object) -> None:
    """Give an amqtt `Broker` a subscription table that awaiting loops may safely walk."""
    table = getattr(broker, "_subscriptions", None)
    if isinstance(table, dict) and not isinstance(table, SnapshotTable):
        broker._subscriptions = SnapshotTable(table)  # type: ignore[attr-defined]


async def wait_for_previous_disconnect(session: Any, grace_s: float = TAKEOVER_GRACE_S) -> None:
    """Wait (at most `grace_s`) until the session's previous connection has gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while session.transitions.is_connected() and loop.time() < deadline:
        await asyncio.sleep(_POLL_S)
