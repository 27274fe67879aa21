"""A device id unique to this machine, for agents started without `--device-id`.

Copying one board's command line (or its SD card) to another is the commonest way to end up
with two devices under one id; a default drawn from the machine makes that slip rarer.
"""

from __future__ import annotations

import re
import socket
import uuid
from pathlib import Path

from protocols import topics

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def machine_fingerprint() -> str:
    """Systemd's machine id (random per installation), else the hardware address, as hex."""
    for path in MACHINE_ID_FILES:
        try:
            text = path.read_text().strip().lower()
        except OSError:
            continue
        if re.fullmatch(r"[0-9a-f]{16,}", text):
            return text
    return f"{uuid.getnode():012x}"


def default_device_id() -> str:
    """`<host name>-<8 hex of the machine id>`, e.g. `raspberrypi-3f2a1c9b`."""
    host = re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname().split(".")[0]).strip("-._")
    machine = machine_fingerprint()
    candidate = f"{host[:40] or 'device'}-{machine[:8]}"
    if topics.device_id_problem(candidate) is not None:  # e.g. a host named pfl-something
        candidate = f"device-{machine[:12]}"
    return candidate
