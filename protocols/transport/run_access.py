"""Per-run accounts for the embedded broker: random passwords, client ids bound to roles, the ACL.

Each identity (the coordinator, each operator tool, devices) gets a random password for one run.
A client id is bound to its account: only the coordinator's account may take the coordinator's
id, an operator tool's ids start with its own account's name (`pfl-viewer-...`), so no tool can
take another's session, and a device's id must be a valid device id, whose topics are then the
only ones it may write, as on the provisioned mosquitto.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from protocols import access, topics
from protocols.access import COORDINATOR_USER, TOOL_USERS, Grant
from protocols.atomic import write_atomically
from protocols.transport.settings import BrokerSettings

DEVICE_USER: Final = "pfl-device"
"""The account every device agent of a run logs in with; its client id names the device."""
_PRIVATE_DIR_MODE: Final = 0o700


def coordinator_client_id(fleet: str) -> str:
    """The MQTT client id of the fleet's coordinator."""
    return f"{topics.RESERVED_PREFIX}coord-{fleet}"


@dataclass(frozen=True)
class Role:
    """What an account may do: which client ids it may use, and its grants for one of them."""

    client_id_ok: Callable[[str, str], bool]
    """(fleet, client id) -> whether this account may connect with that id."""
    grants: Callable[[str, str, int], tuple[Grant, ...]]
    """(fleet, client id, max chunks) -> what that session may write and read."""


def _is_coordinator(fleet: str, client_id: str) -> bool:
    return client_id == coordinator_client_id(fleet)


def _tool(account: str) -> Role:
    """An operator tool's account: ids `<account>-<random>`, the grants `access` gives it."""

    def client_id_ok(fleet: str, client_id: str) -> bool:
        del fleet
        return client_id.startswith(f"{account}-")

    return Role(client_id_ok, lambda fleet, _, __: access.tool_grants(account, fleet))


def _is_device(fleet: str, client_id: str) -> bool:
    del fleet
    return topics.device_id_problem(client_id) is None


ROLES: Final[Mapping[str, Role]] = {
    COORDINATOR_USER: Role(_is_coordinator, lambda fleet, _, __: access.coordinator_grants(fleet)),
    DEVICE_USER: Role(_is_device, access.device_grants),
    **{account: _tool(account) for account in TOOL_USERS},
}
"""Another identity (e.g. a dashboard of its own) is one more entry: its account and Role."""


@dataclass(frozen=True)
class RunAccess:
    """The accounts of one run's embedded broker; `generate()` draws fresh passwords."""

    fleet: str
    passwords: Mapping[str, str]
    roles: Mapping[str, Role] = field(default_factory=lambda: dict(ROLES))
    max_chunks: int = access.chunk_limit(
        access.DEFAULT_MAX_UPLOAD_BYTES, BrokerSettings().chunk_size_bytes
    )

    @classmethod
    def generate(cls, fleet: str, roles: Mapping[str, Role] = ROLES) -> RunAccess:
        """Random 192-bit passwords (OS CSPRNG) for every account in `roles`."""
        return cls(fleet, {account: secrets.token_urlsafe(24) for account in roles}, dict(roles))

    def settings(self, account: str, base: BrokerSettings) -> BrokerSettings:
        """`base` with `account`'s user name and password.

        Raises:
            KeyError: no such account.
        """
        return base.model_copy(update={"username": account, "password": self.passwords[account]})

    def refusal(self, username: str | None, password: str | None, client_id: str) -> str | None:
        """Why a CONNECT is refused, or None to admit it."""
        expected = self.passwords.get(username or "")
        if expected is None or password is None:
            return "unknown user or no password"
        if not secrets.compare_digest(expected.encode(), password.encode()):
            return f"wrong password for {username!r}"
        if not self.roles[str(username)].client_id_ok(self.fleet, client_id):
            return f"client id {client_id!r} is not one {username!r} may use"
        return None

    def allows(self, username: str | None, client_id: str, topic: str, *, write: bool) -> bool:
        """Whether an admitted session may write (or read, subscribe to) `topic`."""
        role = self.roles.get(username or "")
        if role is None or not role.client_id_ok(self.fleet, client_id):
            return False
        grants = role.grants(self.fleet, client_id, self.max_chunks)
        return access.allows(grants, topic, write=write)

    def write_env_files(self, directory: Path, url: str, accounts: tuple[str, ...]) -> list[Path]:
        """`<directory>/<account>.env` (0600, directory 0700) with `PFL_*` for each account.

        E.g. `set -a; . runs/fleet/broker/device.env; set +a` before `pfl-agent start`.

        Raises:
            StateError: a file could not be written.
        """
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(_PRIVATE_DIR_MODE)
        written = []
        for account in accounts:
            path = directory / f"{account.removeprefix(topics.RESERVED_PREFIX)}.env"
            text = (
                f"PFL_BROKER={url}\nPFL_FLEET={self.fleet}\n"
                f"PFL_USERNAME={account}\nPFL_PASSWORD={self.passwords[account]}\n"
            )
            write_atomically(path, text.encode())  # a temporary file of mode 0600, renamed
            written.append(path)
        return written
