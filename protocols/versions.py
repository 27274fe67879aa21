"""The protocol version spoken on the wire and the one rule for accepting another."""

from __future__ import annotations

from typing import Final

PROTOCOL_VERSION: Final = 2
"""2: a run id in announcements and in every answer to one."""
SUPPORTED_PROTOCOL_VERSIONS: Final = frozenset({2})
