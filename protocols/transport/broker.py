"""An embedded MQTT broker (amqtt) on a background thread, for runs with no broker given.

amqtt speaks MQTT 3.1.1 only and moves data several times slower than mosquitto; it is meant
for a laptop, a demo or a test, not for a fleet. It binds loopback addresses only, and with a
`RunAccess` admits only that run's accounts and applies their ACL (`run_access.py`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass

from amqtt.adapters import ReaderAdapter, WriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action, ListenerConfig
from amqtt.errors import MQTTError
from amqtt.mqtt.connack import BAD_USERNAME_PASSWORD, ConnackPacket
from amqtt.mqtt.connect import ConnectPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

from protocols.transport.amqtt_races import snapshot_subscriptions, wait_for_previous_disconnect
from protocols.transport.run_access import RunAccess

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


class _Recorded(ReaderAdapter):
    """A reader that keeps what was read from `source`, to hand the same bytes over again."""

    def __init__(self, source: ReaderAdapter) -> None:
        self.source = source
        self.data = bytearray()

    async def read(self, n: int = -1) -> bytes:
        chunk: bytes = await self.source.read(n)
        self.data += chunk
        return chunk

    def feed_eof(self) -> None:
        self.source.feed_eof()


class _Replay(ReaderAdapter):
    """Bytes already read (a CONNECT packet), served again."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    async def read(self, n: int = -1) -> bytes:
        size = len(self._data) if n < 0 else n
        chunk, self._data = self._data[:size], self._data[size:]
        return chunk

    def feed_eof(self) -> None:
        """Nothing to do: the data is all here."""


class _CheckedBroker(Broker):
    """amqtt's broker with one run's accounts checked before a CONNECT touches any session.

    amqtt itself authenticates after it has already deleted (clean session) or rebound
    (persistent session) the session of the client id a newcomer asks for, and takes over a
    connected one even when authentication then fails: an anonymous client naming the
    coordinator's id would knock it off. Here the CONNECT is read and checked first, refused
    with "bad user name or password", and only an admitted one goes on to amqtt.
    """

    def __init__(self, config: dict[str, object], run_access: RunAccess) -> None:
        super().__init__(config, loop=asyncio.get_running_loop())
        self.run_access = run_access
        snapshot_subscriptions(self)

    async def _initialize_client_session(
        self, reader: ReaderAdapter, writer: WriterAdapter, remote_address: str, remote_port: int
    ) -> tuple[BrokerProtocolHandler, Session]:
        recorded = _Recorded(reader)
        connect = await ConnectPacket.from_stream(recorded)
        who = connect.payload
        refusal = (
            "malformed CONNECT"
            if who is None
            else self.run_access.refusal(who.username, who.password, who.client_id or "")
        )
        if refusal is not None:
            await ConnackPacket.build(0, BAD_USERNAME_PASSWORD).to_stream(writer)
            await writer.close()
            msg = f"refused {remote_address}:{remote_port}: {refusal}"
            raise MQTTError(msg)
        admitted: tuple[BrokerProtocolHandler, Session] = await super()._initialize_client_session(
            _Replay(bytes(recorded.data)), writer, remote_address, remote_port
        )
        return admitted

    async def _authenticate(self, session: Session, listener: ListenerConfig) -> bool:
        # amqtt's own plugin round (AcceptAllAuthPlugin) first: it yields to the loop, which lets
        # the DISCONNECT of a client's previous connection land before a reconnect takes over
        admitted: bool = await super()._authenticate(session, listener)
        await wait_for_previous_disconnect(session)
        refusal = self.run_access.refusal(session.username, session.password, session.client_id)
        return admitted and refusal is None

    async def _topic_filtering(self, session: Session, topic: str, action: Action) -> bool:
        return self.run_access.allows(
            session.username, session.client_id, topic, write=action == Action.PUBLISH
        )


def is_loopback(host: str) -> bool:
    """Whether `host` is `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    """amqtt's broker on its own asyncio loop in a daemon thread; start() returns the port.

    `run_access` is required, and None only on purpose: every local user may then connect as
    anyone (tests of the transport do that).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        run_access: RunAccess | None,
        session_expiry_s: int = 3600,
    ) -> None:
        if not is_loopback(host):
            msg = (
                f"the embedded broker listens on loopback only (127.0.0.1, ::1, localhost), "
                f"not {host!r}: for devices on other machines run mosquitto (docs/security.md)"
            )
            raise ValueError(msg)
        self.host = host
        self.port = port
        self.run_access = run_access
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
        if self.run_access is None:
            self._broker = Broker(config, loop=asyncio.get_running_loop())
            snapshot_subscriptions(self._broker)
        else:
            self._broker = _CheckedBroker(config, self.run_access)
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
