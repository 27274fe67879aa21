"""Whether this device should train now: free memory, CPU load and mains power, as configured.

A phone-like device trains only when it can afford to; a skipped round is reported to the
coordinator (a "skipped" status naming the reason), which stops waiting for this device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from device_agent.capabilities import available_memory_bytes, usable_cores
from protocols.messages import Eligibility

POWER_SUPPLY: Final = Path("/sys/class/power_supply")


@dataclass(frozen=True)
class EligibilityPolicy:
    """Conditions for training; None switches a check off."""

    min_free_memory_bytes: int | None = None
    max_load_per_core: float | None = None
    require_mains_power: bool = False

    def as_wire(self) -> Eligibility:
        """The conditions as the hello tells them (dashboards show why a device declines)."""
        return Eligibility(
            min_free_memory_bytes=self.min_free_memory_bytes,
            max_load_per_core=self.max_load_per_core,
            require_mains_power=self.require_mains_power,
        )

    def reason_to_skip(self) -> str | None:
        """Why this device should not train now, or None if it may."""
        if self.min_free_memory_bytes is not None:
            free = available_memory_bytes()
            if free < self.min_free_memory_bytes:
                return (
                    f"free memory {free / 2**20:.0f} MiB is below the "
                    f"{self.min_free_memory_bytes / 2**20:.0f} MiB required"
                )
        if self.max_load_per_core is not None and hasattr(os, "getloadavg"):
            load = os.getloadavg()[0] / usable_cores()
            if load > self.max_load_per_core:
                return f"CPU load {load:.2f} per core is above {self.max_load_per_core:.2f}"
        if self.require_mains_power and on_battery():
            return "running on battery, and mains power is required"
        return None


def on_battery(power_supply: Path = POWER_SUPPLY) -> bool:
    """True when the machine reports batteries and no online mains adapter.

    Machines without /sys/class/power_supply (most boards and servers) count as on mains.
    """
    if not power_supply.is_dir():
        return False
    kinds: dict[str, list[Path]] = {}
    for supply in power_supply.iterdir():
        try:
            kind = (supply / "type").read_text().strip()
        except OSError:
            continue
        kinds.setdefault(kind, []).append(supply)
    mains = kinds.get("Mains", []) + kinds.get("USB", [])
    if not kinds.get("Battery"):
        return False
    for supply in mains:
        try:
            if (supply / "online").read_text().strip() == "1":
                return False
        except OSError:
            continue
    return True
