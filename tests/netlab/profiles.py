"""Link profiles named after real links, for the fault proxy (and tbf in network namespaces).

Figures are typical published ranges, taken at their unfavourable end, not measurements of any
network: LTE at the cell edge (a few Mbit/s up, ~50 ms one way), a congested Wi-Fi (about a
megabit, heavy jitter, frequent retransmissions), and an NB-IoT-like link (tens of kbit/s,
most of a second one way, multi-second stalls). Packet loss is played as what it costs a TCP
stream: a stall of one retransmission timeout, with `stall_probability` per piece forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

KBIT: Final = 1000 // 8
"""Bytes per second in one kbit/s."""
MBIT: Final = 1000 * KBIT


@dataclass(frozen=True)
class Link:
    """What one link does to a TCP stream, per direction (up: device -> broker)."""

    name: str
    up_bps: int | None = None
    """Uplink bandwidth in bytes per second; None: unlimited."""
    down_bps: int | None = None
    """Downlink bandwidth in bytes per second; None: unlimited."""
    latency_s: float = 0.0
    """One-way delay added to every piece."""
    jitter_s: float = 0.0
    """Up to this much more, uniformly (order is kept, as TCP keeps it)."""
    stall_probability: float = 0.0
    """Chance per forwarded piece of a stall (a lost packet's retransmission timeout)."""
    stall_s: float = 0.0
    """How long one stall holds the stream."""

    def rate(self, direction: Literal["up", "down"]) -> int | None:
        """Bytes per second in `direction`; None: unlimited."""
        return self.up_bps if direction == "up" else self.down_bps


LOOPBACK: Final = Link("loopback")
LTE: Final = Link(
    "lte",
    up_bps=5 * MBIT,
    down_bps=20 * MBIT,
    latency_s=0.05,
    jitter_s=0.015,
    stall_probability=0.002,
    stall_s=0.2,
)
CONGESTED_WIFI: Final = Link(
    "congested-wifi",
    up_bps=1 * MBIT,
    down_bps=2 * MBIT,
    latency_s=0.03,
    jitter_s=0.06,
    stall_probability=0.01,
    stall_s=0.3,
)
NB_IOT_LIKE: Final = Link(
    "nb-iot-like",
    up_bps=30 * KBIT,
    down_bps=60 * KBIT,
    latency_s=0.8,
    jitter_s=0.3,
    stall_probability=0.02,
    stall_s=2.0,
)
PROFILES: Final[dict[str, Link]] = {
    link.name: link for link in (LOOPBACK, LTE, CONGESTED_WIFI, NB_IOT_LIKE)
}


def profile(name: str) -> Link:
    """The profile called `name`.

    Raises:
        KeyError: no such profile (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        msg = f"no link profile {name!r}; known: {', '.join(PROFILES)}"
        raise KeyError(msg) from None
