"""The aggregator tier's part of a fleet view: each aggregator's retained status, checked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final

from coordinator.tier import wire
from protocols.errors import PflError

MAX_AGGREGATORS: Final = 1000
"""Aggregator statuses a view keeps; statuses of further names are refused."""
MAX_STATUS_BYTES: Final = 64 * 1024
_TOPIC: Final = re.compile(r"^pfl/(?P<fleet>[^/]+)/tier/(?P<aggregator>[^/]+)/status$")


@dataclass
class AggregatorViews:
    """The latest status of each aggregator, by name."""

    statuses: dict[str, wire.AggregatorStatus] = field(default_factory=dict)

    def offer(self, fleet: str, topic: str, payload: bytes) -> bool | None:
        """Take an aggregator's status if `topic` is one: None (no such topic), else whether taken.

        Only an aggregator status naming the topic's aggregator, in this fleet, gets in.
        """
        match = _TOPIC.match(topic)
        if match is None or match["fleet"] != fleet:
            return None
        try:
            status, _ = wire.decode(payload, MAX_STATUS_BYTES)
        except PflError:
            return False
        name = match["aggregator"]
        if not isinstance(status, wire.AggregatorStatus) or status.aggregator != name:
            return False
        if name not in self.statuses and len(self.statuses) >= MAX_AGGREGATORS:
            return False
        self.statuses[name] = status
        return True

    def rows(self) -> list[dict[str, Any]]:
        """A row per aggregator, by name."""
        return [
            {
                "aggregator": name,
                "group": status.group,
                "state": status.state,
                "round": status.round_id,
                "asked": status.asked,
                "devices": status.devices,
                "partial_sent": status.partial_sent,
                "partials_sent": status.partials_sent,
                "sent_at": status.sent_at,
            }
            for name, status in sorted(self.statuses.items())
        ]
