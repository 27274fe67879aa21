"""The fleet status the coordinator retains: every device's progress, offences and flags."""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from coordinator.engine.registry import DeviceRecord, DeviceUsage, FleetRegistry
from protocols import topics
from protocols.messages import Eligibility, FleetDevice, FleetStatus
from protocols.offences import Offences

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
    known = {d.device_id for d in devices}
    strangers = sorted(  # senders that never joined, e.g. with hellos that were all dropped
        (s for s in dropped if s not in known and topics.device_id_problem(s) is None),
        key=lambda s: -dropped[s],
    )[:MAX_LISTED_STRANGERS]
    devices += tuple(
        FleetDevice(device_id=s, online=False, last_seen=0.0, dropped=dropped[s])
        for s in sorted(strangers)
    )
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
