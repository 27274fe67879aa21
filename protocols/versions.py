"""The protocol version spoken on the wire and the one rule for accepting another."""

from __future__ import annotations

from typing import Final

PROTOCOL_VERSION: Final = 9
"""2: a run id in announcements and in every answer to one. 3: devices fetch the model only
for work they are asked to do; compressed uplink (`uplink`, `compression`) and model deltas.
4: differential privacy (`privacy` in announcements, `within_clip` in updates).
5: secure aggregation (`secure` in announcements, the `secagg-*` messages and topics).
6: the run history for dashboards (`run-history`), rounds taken and declines per device in the
fleet status. 7: asynchronous rounds (`asynchronous` in announcements). 8: int8 levels summed
under secure aggregation (`int8` in `secure`, the `secagg.levels` tensor). 9: run states in
the coordinator status (waiting, stalled, stopped, with the missing devices, the deadline, a
reason and recent events), bytes and round time per device in the fleet status, `finished_at`
per round in the run history."""
SUPPORTED_PROTOCOL_VERSIONS: Final = frozenset({9})
