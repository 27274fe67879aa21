"""An embedded MQTT broker (amqtt) on a background thread, for runs with no broker given.

amqtt speaks MQTT 3.1.1 only and moves data several times slower than mosquitto; it is meant
for a laptop, a demo or a test, not for a fleet.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass

from amqtt.broker import Broker
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0
_DRAIN_TIMEOUT_S = 2.0
"""How long stop() lets the broker fan out what it accepted (a run's last messages to devices)."""


class AcceptAllAuthPlugin(BaseAuthPlugin):
    """Lets every client in without marking its session anonymous.

    amqtt's own AnonymousAuthPlugin flags every session it admits as anonymous, and amqtt then
    neither keeps an anonymous session after a disconnect nor queues QoS 1 messages for it.
    Persistent sessions are what let a device that drops for a moment catch up, so this plugin
    admits clients the same way but leaves their sessions persistent.
    """

    @dataclass
    class Config:
        """No options."""

    async def authenticate(self, *, session: Session) -> bool:
        """Accept the client."""
        del session
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _quiet_shutdown(record: logging.LogRecord) -> bool:
    """Drop amqtt's "N messages not broadcasted" at shutdown.

    Those are the wills of the devices whose connections the shutdown itself closes, which no
    subscriber is left to receive.
    """
    return not record.getMessage().endswith("messages not broadcasted")


def _in_flight(broker: object) -> bool:
    """Whether amqtt holds messages to fan out or deliveries a connected client has not acked.

    amqtt has no public call for either; a broker without these attributes counts as idle.
    """
    queue = getattr(broker, "_broadcast_queue", None)
    if queue is not None and not queue.empty():
        return True
    sessions = getattr(broker, "_sessions", {})
    return any(
        session.transitions.is_connected() and session.inflight_out
        for session, _ in sessions.values()
    )


class EmbeddedBroker:
    """amqtt's broker on its own asyncio loop in a daemon thread; start() returns the port."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, session_expiry_s: int = 3600
    ) -> None:
        self.host = host
        self.port = port
        self.session_expiry_s = session_expiry_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker: Broker | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where clients connect, e.g. mqtt://127.0.0.1:41883."""
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> int:
        """Bind and serve; return the port (picked free when constructed with port=0).

        Raises:
            RuntimeError: the broker is already running or did not start (e.g. port in use).
        """
        if self._thread is not None:
            msg = f"embedded broker already serving on {self.url}"
            raise RuntimeError(msg)
        if self.port == 0:
            self.port = free_port(self.host)
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=loop.run_forever, name="embedded-broker", daemon=True
        )
        self._thread.start()
        self._loop = loop
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), loop).result(_START_TIMEOUT_S)
        except Exception as error:
            self._halt_loop()
            msg = f"embedded MQTT broker could not start on {self.url}: {error}"
            raise RuntimeError(msg) from error
        logger.info("embedded MQTT broker serving on %s", self.url)
        return self.port

    def stop(self) -> None:
        """Close every connection and the listener, then end the thread; idempotent."""
        if self._loop is None or self._broker is None:
            return
        amqtt_logger = logging.getLogger("amqtt.broker")
        amqtt_logger.addFilter(_quiet_shutdown)
        try:
            asyncio.run_coroutine_threadsafe(self._drain(), self._loop).result(_START_TIMEOUT_S)
            asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(
                _START_TIMEOUT_S
            )
        except Exception:  # shutting down must not mask what the caller was doing
            logger.exception("embedded MQTT broker on %s did not shut down cleanly", self.url)
        finally:
            amqtt_logger.removeFilter(_quiet_shutdown)
            self._halt_loop()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _serve(self) -> None:
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {f"{__name__}.AcceptAllAuthPlugin": {}},
            "session_expiry_interval": self.session_expiry_s,
        }
        self._broker = Broker(config, loop=asyncio.get_running_loop())
        await self._broker.start()

    async def _drain(self) -> None:
        """Wait (briefly) until messages the broker acknowledged have gone to their subscribers.

        A coordinator's last publishes are acknowledged as soon as the broker queues them;
        shutting down at once would drop them (amqtt warns "messages not broadcasted"), and
        closing a connection whose QoS 1 delivery still awaits its PUBACK made amqtt warn of an
        unknown PUBACK and, now and then, hang its shutdown.
        """
        deadline = asyncio.get_running_loop().time() + _DRAIN_TIMEOUT_S
        while _in_flight(self._broker):
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.01)

    def _halt_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._broker = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_START_TIMEOUT_S)
        loop.close()
