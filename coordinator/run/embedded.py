"""The embedded broker of a run given no --broker: loopback only, with this run's accounts."""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocols.access import COORDINATOR_USER, TOOL_USERS
from protocols.errors import PflError
from protocols.transport.run_access import DEVICE_USER, RunAccess
from protocols.transport.settings import BrokerSettings

if TYPE_CHECKING:  # amqtt loads when a run starts its broker, not with the CLI
    from protocols.transport.broker import EmbeddedBroker

ENV_ACCOUNTS = (DEVICE_USER, *TOOL_USERS)
"""The accounts whose `PFL_*` env files a run writes: agents', and one per operator tool
(`operator.env` for export, `viewer.env` for status, `dashboard.env` for the dashboard)."""


class EmbeddedBrokerError(PflError):
    """The embedded broker could not start (e.g. its port is taken)."""


@dataclass(frozen=True)
class EmbeddedRun:
    """A started embedded broker, its accounts, and where their env files are."""

    broker: EmbeddedBroker
    access: RunAccess
    env_files: list[Path]

    def settings(self, base: BrokerSettings, account: str = COORDINATOR_USER) -> BrokerSettings:
        """`base` (the run's transport options) on this broker, as `account`."""
        return self.access.settings(account, base.model_copy(update={"url": self.broker.url}))

    def stop(self) -> None:
        """Stop the broker (the env files stay: they name a password nobody accepts any more)."""
        self.broker.stop()


def start_embedded(host: str, port: int, fleet: str, directory: Path) -> EmbeddedRun:
    """Draw this run's passwords, write `<directory>/<account>.env` files, start the broker.

    The files are written before the broker listens, so a client that waits for the port finds
    them. A port of 0 picks a free one.

    Raises:
        ValueError: `host` is not a loopback address.
        EmbeddedBrokerError: the broker did not start (e.g. the port is in use), in one line.
        StateError: the env files could not be written.
    """
    from protocols.transport.broker import EmbeddedBroker, free_port

    access = RunAccess.generate(fleet)
    broker = EmbeddedBroker(host, port or free_port(host), run_access=access)
    files = access.write_env_files(directory, broker.url, ENV_ACCOUNTS)
    try:
        with _amqtt_start_quiet():
            broker.start()
    except RuntimeError as error:
        raise EmbeddedBrokerError(_start_problem(broker.url, error)) from None
    return EmbeddedRun(broker, access, files)


@contextmanager
def _amqtt_start_quiet() -> Iterator[None]:
    """Without amqtt's own "Broker startup failed" traceback: the error says it in one line."""

    def keep(record: logging.LogRecord) -> bool:
        return record.getMessage() != "Broker startup failed"

    amqtt_logger = logging.getLogger("amqtt.broker")
    amqtt_logger.addFilter(keep)
    try:
        yield
    finally:
        amqtt_logger.removeFilter(keep)


def _start_problem(url: str, error: RuntimeError) -> str:
    """One line on why the broker did not start, and what to do about a port in use."""
    cause = error.__cause__
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    in_use = (cause is not None and cause.errno == errno.EADDRINUSE) or (
        "address already in use" in str(error)
    )
    if in_use:
        return (
            f"cannot start the embedded MQTT broker on {url}: the port is already in use "
            "(another broker, or another serve?); pass --port with a free one, or --broker URL "
            "to use the broker that runs there"
        )
    return f"cannot start the embedded MQTT broker on {url}: {error}"
