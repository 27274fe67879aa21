"""One way for every program to get a transport: `connect(endpoint, client_id, will)`.

An endpoint is a URL (`mqtt://host[:port]`, `mqtts://host[:port]`, `inproc://<hub name>`), the
`BrokerSettings` of a deployment (credentials, TLS files, limits: everything a URL cannot say),
or an in-process hub itself. Programs say where their clients go; which class serves the scheme
is decided here and nowhere else.
"""

from __future__ import annotations

from typing import Final, TypeAlias, overload
from urllib.parse import urlsplit

from pydantic import ValidationError

from protocols.offences import Offences
from protocols.transport.base import Transport, Will
from protocols.transport.inprocess import InProcessBroker, InProcessTransport, named_hub
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings

Endpoint: TypeAlias = str | BrokerSettings | InProcessBroker
"""Where a client connects: a URL, an MQTT deployment's settings, or an in-process hub."""
SCHEMES: Final = ("mqtt", "mqtts", "inproc")


@overload
def connect(
    endpoint: BrokerSettings,
    client_id: str,
    will: Will | None = None,
    *,
    clean_start: bool = False,
    offences: Offences | None = None,
) -> MqttTransport: ...


@overload
def connect(
    endpoint: InProcessBroker,
    client_id: str,
    will: Will | None = None,
    *,
    clean_start: bool = False,
    offences: Offences | None = None,
) -> InProcessTransport: ...


@overload
def connect(
    endpoint: str,
    client_id: str,
    will: Will | None = None,
    *,
    clean_start: bool = False,
    offences: Offences | None = None,
) -> Transport: ...


def connect(
    endpoint: Endpoint,
    client_id: str,
    will: Will | None = None,
    *,
    clean_start: bool = False,
    offences: Offences | None = None,
) -> Transport:
    """A connected client `client_id` of `endpoint`, whose `will` is published if it vanishes.

    `clean_start` discards a session the broker kept for `client_id`; `offences` counts the
    messages an MQTT transport drops at intake. An in-process hub keeps no sessions and drops
    nothing, so both only matter over MQTT.

    Raises:
        ValueError: a URL with an unknown scheme, no host, a bad port, or naming no live hub.
        BrokerConnectionError: the MQTT broker is unreachable or refuses the client.
        ProtocolError: the will is larger than one chunk.
    """
    if isinstance(endpoint, InProcessBroker):
        return endpoint.connect(client_id, will)
    if isinstance(endpoint, str):
        hub_or_broker = resolve(endpoint)
        if isinstance(hub_or_broker, InProcessBroker):
            return hub_or_broker.connect(client_id, will)
        endpoint = hub_or_broker
    return MqttTransport(endpoint, client_id, will=will, clean_start=clean_start, offences=offences)


def resolve(url: str) -> BrokerSettings | InProcessBroker:
    """What `url` names: default settings for an MQTT broker, or a live named hub.

    Raises:
        ValueError: an unknown scheme, an MQTT URL without a usable host and port, or an
            inproc:// URL naming no live hub.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        expected = "mqtt://host[:port], mqtts://host[:port] or inproc://<hub name>"
        # Without "://" there is no scheme (Python 3.10's urlsplit reads "host:port"'s host as one).
        scheme = parts.scheme if "://" in url else ""
        msg = f"transport url {url!r}: unknown scheme {scheme!r}; expected {expected}"
        raise ValueError(msg)
    if parts.scheme == "inproc":
        name = parts.netloc
        if not name or parts.path not in ("", "/") or parts.query or parts.fragment:
            msg = f"transport url {url!r}: expected inproc://<hub name> and nothing after it"
            raise ValueError(msg)
        return named_hub(name)
    try:
        return BrokerSettings(url=url)
    except ValidationError as error:
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in error.errors())
        raise ValueError(reasons) from None
