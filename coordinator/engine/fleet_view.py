"""The fleet status the coordinator retains: every device's progress, offences and flags.

On the wire it is paged (`FleetPages`): a small `FleetSummary` each round and one retained
`FleetRow` per device, republished only when that row changed, so a round costs what changed
in it (its cohort, joins, leaves, offences), not the fleet. `fleet_status` builds the whole view
at once, for a run directory and tests.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

from coordinator.engine.registry import DeviceRecord, DeviceUsage, FleetRegistry
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import Eligibility, FleetDevice, FleetRow, FleetStatus, FleetSummary
from protocols.offences import Offences
from protocols.transport.base import Transport

MAX_LISTED_STRANGERS = 100
"""Senders the fleet status lists although they never joined (the most dropped first)."""


def fleet_status(
    fleet: str,
    round_id: int,
    registry: FleetRegistry,
    offences: Offences,
    *,
    held: AbstractSet[str],
    flapping: AbstractSet[str],
    scalars: Mapping[str, float],
) -> FleetStatus:
    """The registry's view with each device's dropped messages, quarantine and flapping."""
    dropped = offences.counts()
    usage = registry.usage()
    none = DeviceUsage()
    devices = tuple(
        _row(r, usage.get(r.device_id, none), dropped, held=held, flapping=flapping)
        for r in registry.records()
    )
    devices += tuple(_stranger_row(s, dropped) for s in sorted(_strangers(dropped, registry.has)))
    return FleetStatus(
        fleet=fleet,
        round_id=round_id,
        devices=devices,
        scalars={k: v for k, v in scalars.items() if math.isfinite(v)},
    )


def _row(
    r: DeviceRecord,
    use: DeviceUsage,
    dropped: Mapping[str, int],
    *,
    held: AbstractSet[str],
    flapping: AbstractSet[str],
) -> FleetDevice:
    """One device's row: its record, its usage, and what the coordinator holds against it."""
    return FleetDevice(
        device_id=r.device_id,
        online=r.online,
        last_seen=r.last_seen,
        round_id=r.round_id,
        last_loss=r.last_loss,
        num_train_samples=r.num_train_samples,
        memory_plan=r.hello.memory_plan if r.hello is not None else None,
        eligibility=r.hello.eligibility if r.hello is not None else Eligibility(),
        detail=r.detail,
        dropped=dropped.get(r.device_id, 0),
        quarantined=r.device_id in held,
        flapping=r.device_id in flapping,
        rounds_taken=r.rounds_taken,
        declines=r.declines,
        last_decline=r.last_decline,
        bytes_up=use.bytes_up,
        bytes_down=use.bytes_down,
        round_seconds=use.round_seconds,
        missed_deadlines=use.missed_deadlines,
        missed_round=use.missed_round,
    )


def _strangers(dropped: Mapping[str, int], known: Callable[[str], bool]) -> list[str]:
    """The senders that never joined listed (the most dropped, at most MAX_LISTED_STRANGERS).

    E.g. with hellos that were all dropped; `known(id)` says whether the registry has the id.
    """
    return sorted(
        (s for s in dropped if not known(s) and topics.device_id_problem(s) is None),
        key=lambda s: -dropped[s],
    )[:MAX_LISTED_STRANGERS]


def _stranger_row(sender: str, dropped: Mapping[str, int]) -> FleetDevice:
    return FleetDevice(device_id=sender, online=False, last_seen=0.0, dropped=dropped[sender])


class FleetPages:
    """Publishes the fleet status paged: the changed rows, cleared rows, then the summary.

    Keeps an 8-byte digest of each row it retained (not the row), so an unchanged row is not
    sent again. Rows on the broker are bounded by the registry (one per device id a credential
    allows) plus MAX_LISTED_STRANGERS; a stranger's row is cleared when it leaves the list.
    """

    def __init__(self, fleet: str, transport: Transport, registry: FleetRegistry) -> None:
        self.fleet = fleet
        self.transport = transport
        self.registry = registry
        self.epoch = secrets.token_hex(8)
        """This coordinator's incarnation: readers ignore rows an earlier one left retained."""
        self._digests: dict[str, bytes] = {}
        self._strangers: set[str] = set()
        self._dropped: dict[str, int] = {}
        self._held: AbstractSet[str] = frozenset()
        self._flapping: AbstractSet[str] = frozenset()
        self._lock = threading.Lock()  # the round and a quarantine (a handler) may publish at once
        self.rows_published = 0
        """Rows (and clearings) sent so far: what the paging saves is visible in tests."""

    def publish(
        self,
        round_id: int,
        offences: Offences,
        *,
        held: AbstractSet[str],
        flapping: AbstractSet[str],
        scalars: Mapping[str, float],
    ) -> FleetSummary:
        """Retain the rows that changed since the last call and this round's summary.

        One call at a time: two interleaved could leave an older row retained after a newer one.
        """
        with self._lock:
            dropped = offences.counts()  # per sender that ever had a message dropped: few
            changed = self.registry.drain_changed()
            changed |= {s for s, n in dropped.items() if self._dropped.get(s) != n}
            changed |= set(held) ^ set(self._held)
            changed |= set(flapping) ^ set(self._flapping)
            self._dropped, self._held, self._flapping = (
                dropped,
                frozenset(held),
                frozenset(flapping),
            )
            strangers = set(_strangers(dropped, self.registry.has))
            for device_id in sorted(changed | strangers | self._strangers):
                self._refresh(device_id, dropped, strangers, held=held, flapping=flapping)
            self._strangers = strangers
            summary = FleetSummary(
                fleet=self.fleet,
                epoch=self.epoch,
                round_id=round_id,
                registered=self.registry.count(),
                online=self.registry.online_count(),
                quarantined=len(held),
                flapping=len(flapping),
                stragglers=self.registry.stragglers(round_id),
                strangers=len(strangers),
                broadcast_bytes=self.registry.broadcast_bytes(),
                scalars={k: v for k, v in scalars.items() if math.isfinite(v)},
            )
            self.transport.publish(
                topics.fleet_status(self.fleet), encode_frame(summary), retain=True
            )
            return summary

    def _refresh(
        self,
        device_id: str,
        dropped: Mapping[str, int],
        strangers: AbstractSet[str],
        *,
        held: AbstractSet[str],
        flapping: AbstractSet[str],
    ) -> None:
        """Publish `device_id`'s row if it differs from the one retained; clear a row gone."""
        if topics.device_id_problem(device_id) is not None:
            return
        record = self.registry.record(device_id)
        if record is not None:
            use, mark = self.registry.row_usage(device_id)
            row = FleetRow(
                fleet=self.fleet,
                epoch=self.epoch,
                device=_row(record, use, dropped, held=held, flapping=flapping),
                broadcast_mark=mark,
            )
        elif device_id in strangers:
            row = FleetRow(
                fleet=self.fleet,
                epoch=self.epoch,
                device=_stranger_row(device_id, dropped),
                stranger=True,
            )
        else:
            if self._digests.pop(device_id, None) is not None:
                self._send(device_id, b"")  # cleared: no longer listed
            return
        digest = hashlib.blake2b(
            row.model_dump_json(exclude={"sent_at"}).encode(), digest_size=8
        ).digest()
        if self._digests.get(device_id) != digest:
            self._digests[device_id] = digest
            self._send(device_id, encode_frame(row))

    def _send(self, device_id: str, payload: bytes) -> None:
        self.transport.publish(topics.fleet_row(self.fleet, device_id), payload, retain=True)
        self.rows_published += 1
