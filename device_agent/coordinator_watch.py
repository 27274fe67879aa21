"""What an agent makes of its coordinator's status: why it may be idle, and when an end is normal.

Two messages that would otherwise mislead: silence when nothing ever arrives (a coordinator that
never ran, or a fleet the broker's ACL denies), and a warning about a lost connection when the
coordinator finished and its embedded broker stopped, a normal end of a run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from protocols import topics
from protocols.codec import decode_frame
from protocols.errors import PflError
from protocols.messages import CoordinatorStatus
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)

IDLE_AFTER_S = 60.0
"""How long an agent waits for any word of a coordinator before it says why it may be idle."""


_TRANSPORT_LOGGER = "protocols.transport.mqtt"
_LOST = "lost its connection"
ENDED_STATES = ("finished", "offline")
"""A coordinator in these states has ended: its broker going away next is no surprise."""


class CoordinatorWatch:
    """Listens for the fleet's retained coordinator status; warns once if none arrives in time.

    A running (or earlier) coordinator's status is retained, so it arrives at once on
    subscribing. Nothing arrives when no coordinator ever ran for this fleet, or when the
    broker's ACL denies this account the fleet's topics (an agent started for another fleet
    than it was provisioned for): mosquitto grants such subscriptions and drops what matches.
    """

    def __init__(
        self,
        who: str,
        fleet: str,
        broker_url: str,
        after_s: float = IDLE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.who = who
        """Who waits, for the notice: e.g. "device dev-1" or "pool of 30 devices (0-29)"."""
        self.fleet = fleet
        self.broker_url = broker_url
        self.after_s = after_s
        self._clock = clock
        self._since = clock()
        self._heard = threading.Event()
        self._said = False
        self.coordinator_state: str | None = None
        self._end_said = False

    def listen(self, transport: Transport) -> CoordinatorWatch:
        """Subscribe to the coordinator's status of the fleet (a topic every device may read)."""
        transport.subscribe(topics.coordinator_status(self.fleet), self._on_status)
        return self

    def heard(self) -> None:
        """Something came from a coordinator: no notice is needed."""
        self._heard.set()

    def check(self) -> str | None:
        """Warn (once) if nothing came from a coordinator for `after_s` s; return the warning."""
        if self._said or self._heard.is_set() or self._clock() - self._since < self.after_s:
            return None
        self._said = True
        warning = (
            f"{self.who} has received nothing from a coordinator of fleet "
            f"{self.fleet!r} on {self.broker_url} for {self.after_s:g} s: is `pfl-coord serve` "
            f"running for fleet {self.fleet!r}? If this device was provisioned for another "
            "fleet, start it with --fleet NAME (or PFL_FLEET): the broker's ACL denies it "
            "every other fleet's topics without a word"
        )
        logger.warning("%s", warning)
        return warning

    def watch_until(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        """Until `stop` is set: say why the agent may be idle, and a normal end quietly."""
        with self.quiet_normal_end():
            while not stop.wait(poll_s):
                self.check()

    @contextmanager
    def quiet_normal_end(self) -> Iterator[None]:
        """While in the block, a connection lost after the coordinator ended is said as info.

        The transport warns of every lost connection (with the clue to packet limits); after a
        finished run it is the embedded broker stopping, which deserves one plain line.
        """
        transport_logger = logging.getLogger(_TRANSPORT_LOGGER)
        transport_logger.addFilter(self._soften)
        try:
            yield
        finally:
            transport_logger.removeFilter(self._soften)

    def _soften(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or _LOST not in str(record.msg):
            return True
        if self.coordinator_state not in ENDED_STATES:
            return True
        if self._end_said:  # a pool: one line for all its devices
            return False
        self._end_said = True
        ended = "finished" if self.coordinator_state == "finished" else "gone offline"
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg = (
            "the coordinator of fleet %r has %s and its broker closed the connection; "
            "reconnecting until one is back"
        )
        record.args = (self.fleet, ended)
        return True

    def _on_status(self, topic: str, payload: bytes) -> None:
        del topic
        self.heard()
        try:
            message, _ = decode_frame(payload)
        except PflError:
            return  # the agent's own handlers judge what arrives; a state is all this needs
        if isinstance(message, CoordinatorStatus):
            self.coordinator_state = message.state
            if message.state not in ENDED_STATES:
                self._end_said = False  # a new run: its end is said again
