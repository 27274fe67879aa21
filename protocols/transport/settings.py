"""How to reach an MQTT broker: address, credentials, TLS, protocol version and size limits."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
KIB = 1024
MIB = 1024 * KIB


class BrokerSettings(BaseModel):
    """Everything an `MqttTransport` needs to connect; nested into each program's settings.

    Chunking and the reassembly cap live here rather than in the transport so that the
    coordinator and every device agent of one fleet can be configured from one place: a chunk
    size above what the broker accepts makes every large message fail, so it is a property of
    the deployment, not of the code.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    tls_insecure: bool = False
    protocol: Literal["3.1.1", "5"] = "3.1.1"
    keepalive_s: int = Field(default=30, ge=5, le=65535)
    chunk_size_bytes: int = Field(default=256 * KIB, ge=1 * KIB)
    max_payload_bytes: int = Field(default=256 * MIB, ge=1)
    reconnect_min_delay_s: float = Field(default=1.0, gt=0)
    reconnect_max_delay_s: float = Field(default=60.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    session_expiry_s: int = Field(default=3600, ge=0)
    reassembly_timeout_s: float = Field(default=120.0, gt=0)
    max_transfers_per_sender: int = Field(default=4, ge=1)
    """Incomplete chunked messages one device may have open; more drop its oldest."""
    max_queued_per_sender: int = Field(default=4096, ge=1)
    """Inbound messages of one device waiting for the handlers; more drop its oldest."""
    max_messages_per_s: float = Field(default=1000.0, gt=0)
    """One device's sustained inbound rate; the excess is dropped before it is queued."""
    max_burst_messages: int = Field(default=4096, ge=1)
    """Messages one device may send at once (a chunked 256 MiB model is 1024 chunks)."""
    close_timeout_s: float = Field(default=30.0, ge=0)
    max_takeovers: int = Field(default=3, ge=0)
    """Connections lost in a row to a client with the same id before giving up (0: never)."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in _DEFAULT_PORTS:
            msg = (
                f"broker url {value!r} must start with mqtt:// or mqtts:// "
                f"(got scheme {parts.scheme!r})"
            )
            raise ValueError(msg)
        if not parts.hostname:
            msg = f"broker url {value!r} has no host; expected e.g. mqtt://127.0.0.1:1883"
            raise ValueError(msg)
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            msg = f"broker url {value!r} must be scheme://host[:port] with nothing after the port"
            raise ValueError(msg)
        try:
            port = parts.port  # urlsplit validates the port lazily, on access
        except ValueError as error:
            port = 0
            cause: Exception | None = error
        else:
            cause = None
        if port == 0:
            msg = f"broker url {value!r} has an invalid port; use 1-65535"
            raise ValueError(msg) from cause
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> BrokerSettings:
        if (self.cert_file is None) != (self.key_file is None):
            msg = "cert_file and key_file must be given together (client certificate and its key)"
            raise ValueError(msg)
        if self.reconnect_max_delay_s < self.reconnect_min_delay_s:
            msg = "reconnect_max_delay_s must be at least reconnect_min_delay_s"
            raise ValueError(msg)
        return self

    @property
    def host(self) -> str:
        """The broker's host name or address."""
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """The broker's port, defaulting by scheme (1883 plain, 8883 TLS)."""
        parts = urlsplit(self.url)
        return parts.port or _DEFAULT_PORTS[parts.scheme]

    @property
    def tls(self) -> bool:
        """Whether the connection is encrypted (mqtts://)."""
        return urlsplit(self.url).scheme == "mqtts"
