"""Device ids in one line of text: a log line or a status line names a few and counts the rest."""

from __future__ import annotations

from collections.abc import Sequence

SHOWN = 20
"""Ids a line names by default; the rest are counted."""


def listed(ids: Sequence[str], shown: int = SHOWN) -> str:
    """The first `shown` ids, then how many more."""
    more = len(ids) - shown
    return ", ".join(ids[:shown]) + (f" and {more} more" if more > 0 else "")
