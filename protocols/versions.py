"""The protocol version spoken on the wire and the one rule for accepting another."""

from __future__ import annotations

from typing import Final

PROTOCOL_VERSION: Final = 8
"""2: a run id in announcements and in every answer to one. 3: devices fetch the model only
for work they are asked to do; compressed uplink (`uplink`, `compression`) and model deltas.
4: differential privacy (`privacy` in announcements, `within_clip` in updates).
5: secure aggregation (`secure` in announcements, the `secagg-*` messages and topics).
6: the run history for dashboards (`run-history`), rounds taken and declines per device in the
fleet status. 7: asynchronous rounds (`asynchronous` in announcements). 8: int8 levels summed
under secure aggregation (`int8` in `secure`, the `secagg.levels` tensor)."""
SUPPORTED_PROTOCOL_VERSIONS: Final = frozenset({8})
