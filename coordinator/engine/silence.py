"""Devices that stay connected yet let a deadline pass: later waits give them a grace, not it.

A device that is online but never answers (hostile, or hung) would otherwise cost every round
it is asked in the whole deadline. Once it has let one pass, a wait ends when everyone else is
in plus a short grace; it is waited for in full again once it has been heard from (its answer
arrived, even after the round closed, so a device that is only slow is not shut out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Final, TypeVar

from coordinator.engine.intake import Collector
from protocols.transport.base import Transport

Answer = TypeVar("Answer")
GRACE_SHARE: Final = 0.05
"""Of a deadline: how long a wait still goes on, once everyone else is in, for a silent device."""


class SilentDevices:
    """The devices that let a deadline pass while connected and have not been heard from since."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._ids

    def wait(
        self,
        transport: Transport,
        collector: Collector[Answer],
        online: Callable[[], AbstractSet[str]],
        timeout_s: float,
        enough: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait until `collector` settles (or `enough()`): whether it settled before the deadline.

        The asked devices already silent are waited for a grace once the others are in; those
        online that let this deadline pass without answering or declining become silent.
        """
        silent = collector.expected & self._ids

        def settled(waiting_for: Callable[[], AbstractSet[str]]) -> bool:
            return collector.settled(waiting_for()) or (enough is not None and enough())

        # without silent devices the registry's own set goes on: `settled` counts it once per change
        others = online if not silent else (lambda: online() - silent)
        ended = transport.wait_until(lambda: settled(others), timeout_s)
        if ended and silent:  # everyone else is in: the silent ones get a grace, not a deadline
            transport.wait_until(lambda: settled(online), GRACE_SHARE * timeout_s)
        if not ended:
            now = online()
            answered = set(collector.answers) | collector.declined
            self._ids |= {d for d in collector.expected if d in now and d not in answered}
        return ended

    def heard(self, device_ids: Iterable[str]) -> None:
        """These devices answered: waited for in full again."""
        self._ids.difference_update(device_ids)
