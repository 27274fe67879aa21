"""The Transport over a real MQTT broker (paho-mqtt 2.x): sessions, chunking, one dispatch thread.

paho's network thread only enqueues what arrives; one dispatch thread of this transport
reassembles chunks and calls handlers, so a slow handler never stalls keep-alives or acks, and
an exception in a handler is logged and dropped instead of escaping into paho's loop. Sessions
are persistent, so QoS 1 messages published while a device is briefly away reach it on return.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from protocols.errors import ProtocolError
from protocols.offences import Offences
from protocols.topics import chunk_subscription
from protocols.transport import chunking
from protocols.transport.base import MessageHandler, ReconnectHook, Will
from protocols.transport.dispatch import (
    Dispatcher,
    MqttTransportStats,
    Reconnected,
    Replay,
)
from protocols.transport.paho_client import (
    QOS,
    new_client,
    open_client,
    paho_severity,
    report_puback,
    subscriptions,
)
from protocols.transport.paho_client import (
    BrokerConnectionError as BrokerConnectionError,  # raised by the transport: its public name
)
from protocols.transport.settings import BrokerSettings
from protocols.transport.subscriptions import SessionFilters
from protocols.transport.takeover import TakeoverWatch

logger = logging.getLogger(__name__)
_paho_logger = logging.getLogger(f"{__name__}.paho")
_PUBLISH_OVERHEAD = 16  # fixed header, topic length and packet id of a PUBLISH, upper bound


class MqttTransport:
    """A connected MQTT client speaking the Transport interface; connects in the constructor.

    A hook given to `on_reconnect` runs on the dispatch thread, like handlers, after paho
    restored a lost connection, e.g. so a device says hello again to a restarted broker.

    Raises:
        BrokerConnectionError: the broker is unreachable or refuses within connect_timeout_s.
        ProtocolError: the will is larger than one chunk (wills cannot be chunked).
    """

    def __init__(
        self,
        settings: BrokerSettings,
        client_id: str,
        *,
        will: Will | None = None,
        clean_start: bool = False,
        offences: Offences | None = None,
    ) -> None:
        if will is not None and len(will.payload) > settings.chunk_size_bytes:
            msg = f"a will of {len(will.payload)} bytes exceeds chunk_size_bytes"
            raise ProtocolError(msg, topic=will.topic)
        self.client_id = client_id
        self.settings = settings
        self.stats = MqttTransportStats()
        self._reconnect_hook: ReconnectHook | None = None
        self.offences = offences or Offences()
        """Messages dropped at intake, per sender (over a rate, queue or transfer limit)."""
        self._dispatcher = Dispatcher(client_id, settings, self.stats, self.offences)
        self._filters = SessionFilters()
        self._retained_chunks: dict[str, int] = {}
        self._publishing = threading.Lock()
        self._acks = threading.Condition()  # PUBACKs and SUBACKs, from the network thread
        self._unacked: dict[int, tuple[str, int]] = {}
        self._early_acks: dict[int, ReasonCode] = {}
        self._subacks: dict[int, list[ReasonCode]] = {}
        self._connack = threading.Event()
        self._refusal: ReasonCode | str | None = None
        self._max_packet: int | None = None
        self._closed = False
        self._takeovers = TakeoverWatch(client_id, settings.max_takeovers)
        self.displaced: str | None = None
        """Why it stopped reconnecting: another client holds its id (None while it did not)."""
        self._v5 = settings.protocol == "5"
        if clean_start and not self._v5:
            self._discard_session()
        self._client = new_client(settings, client_id, clean_session=False, will=will)
        self._client.on_log = self._on_log
        self._connect(clean_start)
        self._dispatcher.thread.start()

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Send `payload` at QoS 1, in chunks when larger than chunk_size_bytes (`_publish`)."""
        self._publish(topic, payload, retain, None)

    def publish_expiring(
        self, topic: str, payload: bytes, *, retain: bool = False, expiry_s: int
    ) -> None:
        """`publish` with an MQTT 5 message expiry on every chunk (3.1.1 has none: plain).

        The broker then drops the message after `expiry_s` seconds: from the queue it keeps for
        a client that is away or slow, and as the retained message of `topic`.
        """
        expiry = None
        if self._v5:
            expiry = Properties(PacketTypes.PUBLISH)
            expiry.MessageExpiryInterval = max(1, expiry_s)
        self._publish(topic, payload, retain, expiry)

    def _publish(
        self, topic: str, payload: bytes, retain: bool, properties: Properties | None
    ) -> None:
        """Send `payload` at QoS 1, in chunks when larger than chunk_size_bytes.

        Returns once paho has queued every message; while disconnected they wait in the client
        and go out after the reconnect. A retained publish also clears what an earlier retained
        message on `topic` left behind (surplus chunks, or a whole message where chunks now go),
        so a late subscriber never receives a stale mix.

        Raises:
            ProtocolError: the payload exceeds max_payload_bytes or the packet size the broker
                advertised, or the topic is invalid.
            BrokerConnectionError: the transport is closed.
        """
        if self._closed:
            msg = f"transport {self.client_id} is closed"
            raise BrokerConnectionError(msg, topic=topic)
        size, limit = len(payload), self.settings.max_payload_bytes
        if size > limit:
            msg = f"payload of {size} bytes exceeds max_payload_bytes ({limit} bytes)"
            raise ProtocolError(msg, topic=topic)
        with self._publishing:  # keeps each topic's retained bookkeeping in publish order
            replaces = self._retained_chunks.get(topic) if retain else None
            chunk_size = self.settings.chunk_size_bytes
            messages = chunking.messages_for(topic, payload, chunk_size, replaces)
            largest = max(len(t) + len(p) for t, p in messages) + _PUBLISH_OVERHEAD
            if self._max_packet is not None and largest > self._max_packet:
                msg = (
                    f"a {largest}-byte message exceeds the broker's maximum packet size of "
                    f"{self._max_packet} bytes; lower chunk_size_bytes"
                )
                raise ProtocolError(msg, topic=topic)
            for message_topic, data in messages:
                self._send(message_topic, data, retain, properties)
            if retain:
                self._retained_chunks[topic] = chunking.chunk_count(size, chunk_size)
            self.stats.bytes_sent += size
            self.stats.messages_sent += 1

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Call `handler` for matching messages; returns once the broker acknowledged.

        Also subscribes to `pattern/chunk/+` (unless `pattern` ends in '#'), where the chunks
        of large payloads arrive.

        Raises:
            ProtocolError: the pattern is invalid or the broker refused the subscription.
        """
        filters = [pattern] if pattern.endswith("#") else [pattern, chunk_subscription(pattern)]
        with self._dispatcher.lock:
            self._dispatcher.handlers.append((pattern, handler))
            new = self._filters.add(filters)
        try:
            if new:
                self._subscribe_filters(pattern, new)
        except ProtocolError:
            with self._dispatcher.lock:
                self._dispatcher.handlers.remove((pattern, handler))
                self._filters.remove(new)
            raise
        self._dispatcher.put(Replay(pattern, handler))

    def unsubscribe(self, pattern: str) -> None:
        """Stop receiving `pattern` (and its chunk topics); does not wait for the UNSUBACK.

        A message already on its way lands unclaimed and goes to the next matching subscription.
        Also sent for a pattern without handlers: it clears what a kept session still holds.
        """
        filters = [pattern] if pattern.endswith("#") else [pattern, chunk_subscription(pattern)]
        with self._dispatcher.lock:
            self._dispatcher.handlers = [
                (p, h) for p, h in self._dispatcher.handlers if p != pattern
            ]
            self._filters.remove(filters)
        try:
            self._client.unsubscribe(filters)
        except ValueError as error:
            msg = f"invalid subscription pattern: {error}"
            raise ProtocolError(msg, topic=pattern) from error

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Let messages flow until `predicate()` holds or `timeout_s` passes; return predicate().

        Called from a handler it returns predicate() at once, as the in-process transport does.
        """
        return self._dispatcher.wait_until(predicate, timeout_s)

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        """Run `hook` on the dispatch thread, in order with messages, after each reconnect."""
        self._reconnect_hook = hook

    @property
    def connected(self) -> bool:
        """Whether the connection is up right now (paho reconnects by itself when it is not)."""
        return self._client.is_connected()

    def flush(self, timeout_s: float) -> bool:
        """Wait until the broker acknowledged every publish so far; False on timeout."""
        with self._acks:
            return self._acks.wait_for(lambda: not self._unacked, timeout_s)

    def close(self) -> None:
        """Deliver what is queued, then disconnect cleanly: the broker does not publish the will."""
        if self._closed:
            return
        if self.connected and not self.flush(self.settings.close_timeout_s):
            logger.warning("%s closing with messages unacknowledged", self.client_id)
        self._closed = True
        self._client.disconnect()
        self._client.loop_stop()
        self._dispatcher.stop(self.settings.close_timeout_s)

    def abort(self) -> None:
        """Drop the connection without DISCONNECT, as a crash would: the broker sends the will."""
        if self._closed:
            return
        self._closed = True
        sock = self._client.socket()
        self._client.loop_stop()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if sock is not None:
            sock.close()
        self._dispatcher.stop(self.settings.close_timeout_s)

    def __enter__(self) -> MqttTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(
        self, topic: str, data: bytes, retain: bool, properties: Properties | None = None
    ) -> None:
        try:
            info = self._client.publish(topic, data, qos=QOS, retain=retain, properties=properties)
        except ValueError as error:
            msg = f"cannot publish: {error}"
            raise ProtocolError(msg, topic=topic) from error
        if info.rc not in (paho.MQTT_ERR_SUCCESS, paho.MQTT_ERR_NO_CONN):  # NO_CONN: queued
            msg = f"paho refused to queue a {len(data)}-byte message: {paho.error_string(info.rc)}"
            raise ProtocolError(msg, topic=topic)
        self.stats.wire_bytes_sent += len(data)
        with self._acks:  # the PUBACK may already be in: paho acks on its own thread
            code = self._early_acks.pop(info.mid, None)
            if code is None:
                self._unacked[info.mid] = (topic, len(data))
        if code is not None:
            report_puback(code, topic, len(data))

    def _subscribe_filters(self, pattern: str, filters: list[str]) -> None:
        try:
            result, mid = self._client.subscribe(subscriptions(filters, v5=self._v5))
        except ValueError as error:
            msg = f"invalid subscription pattern: {error}"
            raise ProtocolError(msg, topic=pattern) from error
        if result != paho.MQTT_ERR_SUCCESS or mid is None:
            return  # not connected: on_connect subscribes every filter after the reconnect
        with self._acks:
            if not self._acks.wait_for(
                lambda: mid in self._subacks, self.settings.connect_timeout_s
            ):
                logger.warning("no SUBACK for %s yet; it is re-sent on reconnect", pattern)
                return
            codes = self._subacks.pop(mid)
        if any(code.is_failure for code in codes):
            msg = f"broker refused the subscription: {', '.join(map(str, codes))}"
            raise ProtocolError(msg, topic=pattern)
        self._filters.confirmed(filters)

    def _connect(self, clean_start: bool) -> None:
        client, settings = self._client, self.settings
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = self._on_connect_fail
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        if self._v5:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = settings.session_expiry_s
            start = paho.MQTT_CLEAN_START_FIRST_ONLY if clean_start else False
            open_client(client, settings, clean_start=start, properties=properties)
        else:
            open_client(client, settings)
        answered = self._connack.wait(settings.connect_timeout_s)
        if answered and self._refusal is None:
            return
        reason = self._refusal or f"no CONNACK within {settings.connect_timeout_s} s"
        if not answered and self._v5:
            reason = f"{reason} (a broker that speaks only MQTT 3.1.1, like amqtt, stays silent)"
        self._closed = True
        client.disconnect()
        client.loop_stop()
        msg = f"cannot connect to the MQTT broker at {settings.url}: {reason}"
        raise BrokerConnectionError(msg)

    def _discard_session(self) -> None:
        """MQTT 3.1.1 has no clean-start-once: connect with a clean session once to drop it."""
        client = new_client(self.settings, self.client_id, clean_session=True, will=None)
        client.on_connect = lambda *_: self._connack.set()
        open_client(client, self.settings)
        self._connack.wait(self.settings.connect_timeout_s)
        client.disconnect()
        client.loop_stop()
        self._connack.clear()

    # paho callbacks run on its network thread and must not raise: paho lets it escape.

    def _on_connect(
        self,
        client: paho.Client,
        _: object,
        flags: paho.ConnectFlags,
        reason: ReasonCode,
        props: object,
    ) -> None:
        try:
            if reason.is_failure:
                logger.warning("%s refused %s: %s", self.settings.url, self.client_id, reason)
                self._refusal = reason
                self._takeovers.connect_failed()
                return
            self._max_packet = getattr(props, "MaximumPacketSize", None)
            self._takeovers.connected(bool(flags.session_present))
            logger.info(
                "%s connected to %s (session present: %s)",
                self.client_id,
                self.settings.url,
                flags.session_present,
            )
            filters = self._filters.to_resubscribe(bool(flags.session_present))
            if filters:  # all of them if the broker lost the session (restart, expiry)
                result, mid = client.subscribe(subscriptions(filters, v5=self._v5))
                if result == paho.MQTT_ERR_SUCCESS and mid is not None:
                    self._filters.resubscribing(mid, filters)
            hook = self._reconnect_hook
            if hook is not None and self._connack.is_set():
                self._dispatcher.put(Reconnected(hook))
        except Exception:
            logger.exception("%s: on_connect failed", self.client_id)
        finally:
            self._connack.set()

    def _on_disconnect(
        self, _c: paho.Client, _u: object, _f: object, reason: ReasonCode, _p: object
    ) -> None:
        if self._closed:
            return
        if not self._connack.is_set():
            self._refusal = f"the broker closed the connection before CONNACK ({reason})"
            self._connack.set()
            return
        verdict = self._takeovers.disconnected(reason.value)
        if verdict is not None:
            self._give_up(verdict)
            return
        with self._acks:
            largest = max((size for _, size in self._unacked.values()), default=0)
        # A broker capping packets below a chunk (mosquitto's max_packet_size under MQTT 3.1.1,
        # message_size_limit under 5) drops the connection rather than refusing the message,
        # and paho re-sends it after each reconnect: the size in this line is the clue.
        logger.warning(
            "%s lost its connection to %s (%s), reconnecting; largest unacknowledged message: "
            "%d bytes (chunk_size_bytes %d)",
            self.client_id,
            self.settings.url,
            reason,
            largest,
            self.settings.chunk_size_bytes,
        )

    def _give_up(self, verdict: str) -> None:
        """Another client holds our id: stop reconnecting (from paho's own thread) and say why."""
        self.displaced = verdict
        logger.error("%s", verdict)
        self._closed = True
        self._client.disconnect()

    def _on_connect_fail(self, _c: paho.Client, _u: object) -> None:
        self._takeovers.connect_failed()

    def _on_log(self, _c: paho.Client, _u: object, level: int, text: str) -> None:
        _paho_logger.log(
            paho_severity(level, text, closed=self._closed), "%s: %s", self.client_id, text
        )

    def _on_message(self, _c: paho.Client, _u: object, message: paho.MQTTMessage) -> None:
        try:
            self._dispatcher.put((message.topic, bytes(message.payload)))
        except Exception:
            logger.exception("%s dropped an undecodable message", self.client_id)

    def _on_publish(
        self, _c: paho.Client, _u: object, mid: int, reason: ReasonCode, _p: object
    ) -> None:
        try:
            with self._acks:
                sent = self._unacked.pop(mid, None)
                if sent is None:
                    self._early_acks[mid] = reason
                self._acks.notify_all()
            if sent is not None:
                report_puback(reason, *sent)
        except Exception:
            logger.exception("%s: on_publish failed", self.client_id)

    def _on_subscribe(
        self, _c: paho.Client, _u: object, mid: int, codes: list[ReasonCode], _p: object
    ) -> None:
        try:
            if self._filters.acknowledged(mid, codes):
                return
            with self._acks:
                self._subacks[mid] = codes
                while len(self._subacks) > 256:  # acks of waits that timed out
                    del self._subacks[next(iter(self._subacks))]
                self._acks.notify_all()
        except Exception:
            logger.exception("%s: on_subscribe failed", self.client_id)
