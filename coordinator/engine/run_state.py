"""What the coordinator tells operators it is doing: its state, whom a round waits for, events.

A run that waits for a device must not look healthy. While a round waits, the retained status
says `waiting` (the devices missing, the deadline), refreshed every REFRESH_S, not per message;
once no answer has arrived for STALL_SHARE of the round timeout while devices are still missing
it says `stalled`. A run short of devices between rounds (`short_of_devices`) is `waiting` for
them, then `stalled` after STALL_SHARE of its join timeout; a run that ends early is `stopped`
with its reason. The last MAX_STATUS_EVENTS events travel with every status, so a page opened
late still sees them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal

from coordinator.engine.round_types import RoundRecord
from protocols.messages import MAX_LISTED_MISSING, MAX_STATUS_EVENTS, RunEvent
from protocols.transport.base import Transport, TransportWrapper

REFRESH_S: Final = 5.0
"""How often a waiting status is republished (its missing devices and the time left)."""
FIRST_SHOWN_S: Final = 1.0
"""How long a round waits before its status says so: quick rounds publish no waiting status."""
STALL_SHARE: Final = 0.5
"""Of the round timeout: no answer for this long while devices are missing is a stall."""
Level = Literal["info", "warn", "error"]
Publish = Callable[..., None]
"""Publishes the retained coordinator status with these fields (state, missing, events, ...)."""


Outstanding = Callable[[], AbstractSet[str]]
"""What a wait is for: the devices asked, online, that have neither answered nor declined."""


@dataclass
class _Wait:
    """One round's wait, as the status shows it."""

    outstanding: Outstanding
    started: float
    deadline: float
    stall_after_s: float
    last_progress: float
    left: int
    shown_at: float | None = None


class RunState:
    """The coordinator's retained status: set by the run, refreshed by the rounds' waits.

    Args:
        publish: sends the status with the fields given (the engine adds fleet, task, round).
        clock: epoch seconds (tests pass a fake one).
    """

    def __init__(
        self,
        publish: Publish,
        *,
        clock: Callable[[], float] = time.time,
        refresh_s: float = REFRESH_S,
        first_shown_s: float = FIRST_SHOWN_S,
    ) -> None:
        self._publish = publish
        self._clock = clock
        self._refresh_s = refresh_s
        self._first_shown_s = first_shown_s
        self.state = "online"
        self.stop_reason = ""
        """Why the run ends early ("" while it has not): summary.json's `stop_reason`."""
        self._events: deque[RunEvent] = deque(maxlen=MAX_STATUS_EVENTS)
        self._fields: dict[str, Any] = {}
        self._wait: _Wait | None = None
        self._short: tuple[str, dict[str, Any], float] | None = None  # before it, stall time

    def set(self, state: str, **fields: Any) -> None:
        """Publish `state` (with details such as `reason`) now."""
        self.state, self._fields = state, fields
        self.republish()

    def republish(self) -> None:
        """Publish the current status again (a restarted broker lost it)."""
        self._publish(state=self.state, events=tuple(self._events), **self._fields)

    def event(self, level: Level, text: str) -> None:
        """Note an event; it goes out with the next status (now, when `level` is not info)."""
        self._note(level, text)
        if level != "info":
            self.republish()

    def _note(self, level: Level, text: str) -> None:
        self._events.append(RunEvent(at=self._clock(), level=level, text=text[:1024]))

    def stopping(self, reason: str) -> None:
        """The run will end early: `finish` publishes `stopped` with this reason."""
        self.stop_reason = reason
        self.event("warn", reason)

    def stop(self, reason: str) -> None:
        """The run ends now, early (interrupted, failed): publish `stopped`."""
        self.stop_reason = reason
        self._note("error", reason)
        self.set("stopped", reason=reason[:1024])

    def finish(self, skipped_reason: str = "") -> None:
        """The run is over: `finished`, or `stopped` when it stopped early or did nothing.

        `skipped_reason` (from `all_skipped`): every round was skipped, so the run stopped.
        """
        if skipped_reason and not self.stop_reason:
            self.stopping(skipped_reason)
        if self.stop_reason:
            self.set("stopped", reason=self.stop_reason[:1024])
        else:
            self.set("finished")

    def short_of_devices(
        self, needed: int, online: int, missing: list[str], *, joined: bool, deadline: float
    ) -> None:
        """Fewer than `needed` devices are online: `waiting` for them until `deadline` (epoch).

        `joined`: the run had its devices once (they are to come back, not to join). Once the
        shortfall has lasted STALL_SHARE of the time it was given, the run is `stalled`.
        """
        now = self._clock()
        if self._short is None:
            stall_at = now + STALL_SHARE * max(0.0, deadline - now)
            self._short = (self.state, self._fields, stall_at)
        what = "come back" if joined else "join"
        reason = f"waiting for {needed} device(s) to {what}: {online} online"
        state = "stalled" if now >= self._short[2] else "waiting"
        fields = {"reason": reason, "deadline": deadline, **_missing_fields(missing)}
        if (state, fields) == (self.state, self._fields):
            return
        if state == "stalled" and self.state != "stalled":
            self._note("warn", f"stalled: {reason}")
        elif joined and self.state not in ("waiting", "stalled"):
            self._note("warn", reason)
        self.set(state, **fields)

    def enough_devices(self) -> None:
        """The devices `short_of_devices` waited for are there: back to the state before."""
        if self._short is not None:
            state, fields, _ = self._short
            self._short = None
            self.set(state, **fields)

    @contextmanager
    def waiting(self, outstanding: Outstanding, timeout_s: float) -> Iterator[_Watch]:
        """A round waits up to `timeout_s` for `outstanding()`: its status follows the wait.

        The state is restored when the wait ends, and republished if the wait was shown.
        """
        now = self._clock()
        count = len(outstanding())
        before_state, before_fields = self.state, self._fields
        self._wait = _Wait(outstanding, now, now + timeout_s, STALL_SHARE * timeout_s, now, count)
        try:
            yield _Watch(self)
        finally:
            shown = self._wait is not None and self._wait.shown_at is not None
            self._wait = None
            if shown:
                self.set(before_state, **before_fields)

    def tick(self) -> None:
        """Called often during a wait (cheap): publish its progress when due."""
        wait = self._wait
        if wait is None:
            return
        now = self._clock()
        due = wait.started + self._first_shown_s if wait.shown_at is None else wait.shown_at
        if wait.shown_at is not None:
            due += self._refresh_s
        if now < due:
            return
        missing = sorted(wait.outstanding())
        if len(missing) < wait.left:
            wait.last_progress = now
        wait.left = len(missing)
        quiet = now - wait.last_progress
        stalled = bool(missing) and quiet >= wait.stall_after_s
        fields = {"deadline": wait.deadline, **_missing_fields(missing)}
        if stalled:
            reason = f"no answer for {quiet:.0f} s; waiting for {len(missing)} device(s)"
            if self.state != "stalled":
                self._note("warn", reason)
            self.state, self._fields = "stalled", {"reason": reason, **fields}
        else:
            self.state, self._fields = "waiting", fields
        wait.shown_at = now
        self.republish()


class _Watch:
    """A wait in progress: wraps the transport it waits on so every check ticks the status."""

    def __init__(self, run_state: RunState) -> None:
        self._run_state = run_state

    def transport(self, transport: Transport) -> Transport:
        """`transport`, whose waits also publish the round's progress when due."""
        return _Ticking(transport, self._run_state.tick)


class _Ticking(TransportWrapper):
    """Each check of a wait's predicate also gives the run state its tick."""

    def __init__(self, inner: Transport, tick: Callable[[], None]) -> None:
        super().__init__(inner)
        self._tick = tick

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait through the inner transport, ticking while the predicate does not hold."""

        def checked() -> bool:
            if predicate():
                return True
            self._tick()
            return False

        return self.inner.wait_until(checked, timeout_s)


def _missing_fields(missing: list[str]) -> dict[str, Any]:
    return {"missing": tuple(missing[:MAX_LISTED_MISSING]), "missing_count": len(missing)}


def all_skipped(records: Sequence[RoundRecord]) -> str:
    """The stop reason of a run whose every round was skipped ("" when one counted).

    A skipped round is one whose aggregate was rejected or that no update reached in time.
    """
    skipped = sum(1 for r in records if r.scalars.get("aggregate_rejected"))
    if not records or skipped < len(records):
        return ""
    return f"all {len(records)} round(s) were skipped: the model never changed"
