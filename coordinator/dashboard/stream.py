"""What the event stream sends: the first snapshot whole, then only what changed, gzipped.

A page holds the last snapshot it got; each push after the first names the keys whose value
changed and, for the long lists (fleet rows, device results, rounds), only the rows added,
changed or gone, keyed by their id. With gzip (when the browser accepts it) the stream is one
deflate stream flushed after every event, so repeated names and ids cost almost nothing.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Final

KEYED_LISTS: Final = {"fleet": "device", "devices": "device_id", "rounds": "round_id"}
"""Snapshot lists sent as row changes, and the field that names a row."""


def snapshot_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What turns `before` into `after`: `set` holds changed keys, `lists` row changes.

    A list's change is `{"upsert": [rows new or changed], "remove": [ids gone]}`; the page
    keeps each list ordered by its id.
    """
    changed: dict[str, Any] = {}
    lists: dict[str, dict[str, list[Any]]] = {}
    for key, value in after.items():
        if key in KEYED_LISTS and isinstance(before.get(key), list):
            rows = _row_changes(before[key], value, KEYED_LISTS[key])
            if rows is not None:
                lists[key] = rows
        elif before.get(key) != value:
            changed[key] = value
    gone = [key for key in before if key not in after]
    return {"set": changed, "lists": lists, "unset": gone}


def _row_changes(
    before: list[dict[str, Any]], after: list[dict[str, Any]], ident: str
) -> dict[str, list[Any]] | None:
    old = {row[ident]: row for row in before}
    upsert = [row for row in after if old.get(row[ident]) != row]
    kept = {row[ident] for row in after}
    remove = [key for key in old if key not in kept]
    return {"upsert": upsert, "remove": remove} if upsert or remove else None


class EventEncoder:
    """Server-sent events as bytes: plain, or one gzip stream flushed after each event."""

    def __init__(self, gzip: bool) -> None:
        self.gzip = gzip
        self._deflate = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip else None
        self.sent = 0
        """Bytes handed to the connection so far (after compression)."""

    def event(self, name: str, data: dict[str, Any], now: float) -> bytes:
        """One `event: name` whose data is `data` with the server's clock as `now`."""
        text = json.dumps({"now": now, **data}, allow_nan=False, separators=(",", ":"))
        return self.raw(f"event: {name}\ndata: {text}\n\n")

    def raw(self, text: str) -> bytes:
        """`text` as it goes on the wire."""
        data = text.encode()
        if self._deflate is not None:
            data = self._deflate.compress(data) + self._deflate.flush(zlib.Z_SYNC_FLUSH)
        self.sent += len(data)
        return data


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header lists gzip (and not with q=0)."""
    for part in header.lower().split(","):
        name, _, params = part.strip().partition(";")
        if name.strip() in ("gzip", "*"):
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False
