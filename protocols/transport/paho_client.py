"""paho-mqtt's client as the MQTT transport configures it, from the broker settings.

Kept apart from the transport's session and flow logic (protocols/transport/mqtt.py): how a paho
client is made, opened and told to subscribe, and how its log lines and refusals are reported.
"""

from __future__ import annotations

import logging
import ssl
from typing import Final, Literal

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from protocols.errors import PflError
from protocols.transport.base import Will
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger("protocols.transport.mqtt")
_PAHO_LOG_LEVELS: Final[dict[int, int]] = {int(k): v for k, v in paho.LOGGING_LEVEL.items()}
_PAHO_RETRYING: Final = "Client is not connected"

QOS: Final = 1


class BrokerConnectionError(PflError, ConnectionError):
    """The broker cannot be reached, refused the connection, or the transport is closed."""


def paho_severity(level: int, text: str, *, closed: bool) -> int:
    """The logging level for one of paho's log lines.

    paho logs "Client is not connected" as an error each time its loop runs between reconnect
    attempts, and its loop may trip over a socket `close()` just closed; neither is news: the
    transport says once that it lost the connection and is reconnecting, and says when it is back.
    """
    if closed or text.startswith(_PAHO_RETRYING):
        return logging.DEBUG
    return _PAHO_LOG_LEVELS.get(level, logging.DEBUG)


def new_client(
    settings: BrokerSettings, client_id: str, *, clean_session: bool, will: Will | None
) -> paho.Client:
    """A paho client with the broker's account, TLS, reconnect delays and will; not connected."""
    v5 = settings.protocol == "5"
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
        clean_session=None if v5 else clean_session,
    )
    client.connect_timeout = settings.connect_timeout_s
    # paho annotates whole seconds but sleeps for any float; tests reconnect within 0.1 s
    client.reconnect_delay_set(
        settings.reconnect_min_delay_s,  # type: ignore[arg-type]
        settings.reconnect_max_delay_s,  # type: ignore[arg-type]
    )
    if settings.username is not None:
        client.username_pw_set(settings.username, settings.password)
    if settings.tls:
        client.tls_set(
            settings.ca_file, settings.cert_file, settings.key_file, cert_reqs=ssl.CERT_REQUIRED
        )
        client.tls_insecure_set(settings.tls_insecure)
    if will is not None:
        client.will_set(will.topic, will.payload, qos=QOS, retain=will.retain)
    return client


def open_client(
    client: paho.Client,
    settings: BrokerSettings,
    clean_start: bool | Literal[3] = paho.MQTT_CLEAN_START_FIRST_ONLY,
    properties: Properties | None = None,
) -> None:
    """Start connecting and paho's network thread; the CONNACK arrives on that thread.

    Raises:
        BrokerConnectionError: the address cannot be resolved or the socket cannot open.
    """
    try:
        client.connect(
            settings.host,
            settings.port,
            settings.keepalive_s,
            clean_start=clean_start,
            properties=properties,
        )
    except (OSError, ValueError) as error:
        msg = f"cannot reach the MQTT broker at {settings.url}: {error}"
        raise BrokerConnectionError(msg) from error
    client.loop_start()


def subscriptions(
    filters: list[str], *, v5: bool
) -> list[tuple[str, SubscribeOptions]] | list[tuple[str, int]]:
    """The SUBSCRIBE entries for `filters` at QoS 1."""
    if v5:  # MQTT 5 can skip re-sending retained messages a kept session had
        return [(f, SubscribeOptions(qos=QOS, retainHandling=1)) for f in filters]
    return [(f, QOS) for f in filters]


def report_puback(reason: ReasonCode, topic: str, size: int) -> None:
    """Log a broker's refusal of a publish."""
    if reason.is_failure:  # only MQTT 5 brokers say so; 3.1.1 brokers drop silently
        logger.error("broker refused a %d-byte message on %s: %s", size, topic, reason)
