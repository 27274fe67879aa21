"""The line a program says at start: which broker, fleet and identity, and which PFL_ variables.

Flags win over `PFL_*` variables, which win over a TOML file: a variable left in a shell
silently decides any setting no flag gives, so the start line names every one that is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "PFL_"


def pfl_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The names (never the values) of the `PFL_*` variables set, sorted."""
    environ = os.environ if environ is None else environ
    return sorted(name for name, value in environ.items() if name.startswith(PREFIX) and value)


def start_line(
    role: str,
    broker_url: str,
    fleet: str,
    username: str | None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """E.g. `device dev-1 on mqtts://h:8883, fleet lab, user dev-1; PFL_ variables set: ...`."""
    user = f"user {username}" if username else "no user name"
    line = f"{role} on {broker_url}, fleet {fleet}, {user}"
    names = pfl_variables(environ)
    if names:
        line += f"; PFL_ variables set: {', '.join(names)} (each applies where no flag is given)"
    return line
