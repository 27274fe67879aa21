"""A simulation's aggregator tier: one aggregator per name on the hub, devices hashed to them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.tier.group import GroupAggregator, hashed_member
from protocols.transport.base import Transport


def local_aggregators(
    names: Sequence[str], fleet: str, connect: Callable[[str], Transport] | None
) -> list[GroupAggregator]:
    """Start `names`' aggregators as clients of the simulation's hub (none without names).

    Raises:
        ValueError: the tier is asked for where the simulation cannot run it (over MQTT).
    """
    if not names:
        return []
    if connect is None:
        msg = (
            "a simulation runs the aggregator tier on its in-process hub; over MQTT start "
            "`pfl-coord aggregator` processes beside `pfl-coord serve`"
        )
        raise ValueError(msg)
    aggregators = []
    for index, name in enumerate(sorted(names)):
        aggregator = GroupAggregator(
            connect(f"pfl-aggregator-{name}"),
            fleet,
            name,
            hashed_member(index, len(names)),
            group=f"hash group {index} of {len(names)}",
        )
        aggregator.start()
        aggregators.append(aggregator)
    return aggregators
