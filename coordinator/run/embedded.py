"""The embedded broker of a run given no --broker: loopback only, with this run's accounts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocols.access import COORDINATOR_USER, TOOL_USERS
from protocols.transport.broker import EmbeddedBroker, free_port
from protocols.transport.run_access import DEVICE_USER, RunAccess
from protocols.transport.settings import BrokerSettings

ENV_ACCOUNTS = (DEVICE_USER, *TOOL_USERS)
"""The accounts whose `PFL_*` env files a run writes: agents', and one per operator tool
(`operator.env` for export, `viewer.env` for status, `dashboard.env` for the dashboard)."""


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
        RuntimeError: the broker did not start (e.g. the port is in use).
        StateError: the env files could not be written.
    """
    access = RunAccess.generate(fleet)
    broker = EmbeddedBroker(host, port or free_port(host), run_access=access)
    files = access.write_env_files(directory, broker.url, ENV_ACCOUNTS)
    broker.start()
    return EmbeddedRun(broker, access, files)
