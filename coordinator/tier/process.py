"""`pfl-coord aggregator`: one aggregator process, next to its site's broker, until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from coordinator.tier import wire
from coordinator.tier.group import GroupAggregator, hashed_member, listed_member
from coordinator.tier.settings import AggregatorSettings
from protocols.transport.base import Will
from protocols.transport.factory import connect

logger = logging.getLogger(__name__)


def run_aggregator(
    settings: AggregatorSettings,
    stop: threading.Event,
    ready: Callable[[], None] | None = None,
) -> GroupAggregator:
    """Serve `settings`' group on its broker until `stop` is set; the aggregator, for its counts.

    A restarted aggregator picks the round in progress up from the retained plan and
    announcement; what its devices sent before it came back is that round's loss only.

    Raises:
        ValueError: the group is not given once (a site list or a hash group).
        BrokerConnectionError: the broker is unreachable or refuses the account.
    """
    problem = settings.problem()
    if problem is not None or settings.broker is None or settings.name is None:
        raise ValueError(problem)
    member = (
        listed_member(settings.devices)
        if settings.devices
        else hashed_member(settings.index, settings.groups)
    )
    group = (
        f"{len(settings.devices)} listed devices"
        if settings.devices
        else f"hash group {settings.index} of {settings.groups}"
    )
    gone = wire.AggregatorStatus(aggregator=settings.name, group=group, state="offline")
    will = Will(wire.status_topic(settings.fleet, settings.name), wire.encode(gone))
    transport = connect(
        settings.broker_settings(settings.broker), settings.name, will, clean_start=True
    )
    aggregator = GroupAggregator(
        transport,
        settings.fleet,
        settings.name,
        member,
        quarantine_after=settings.quarantine_after,
        group=group,
    )
    aggregator.start()
    logger.info(
        "aggregator %s serves fleet %s on %s", settings.name, settings.fleet, settings.broker
    )
    if ready is not None:
        ready()
    try:
        stop.wait()
    finally:
        transport.publish(
            wire.status_topic(settings.fleet, settings.name),
            wire.encode(aggregator.status("offline")),
            retain=True,
        )
        transport.close()
    return aggregator
