"""The MQTT client id an operator tool logs in with: its own, so tools never displace each other."""

from __future__ import annotations

import uuid

from protocols import topics
from protocols.access import COORDINATOR_USER
from protocols.errors import PflError
from protocols.transport.settings import BrokerSettings


class ToolAccountError(PflError):
    """An operator tool was given an account whose session it would take over."""


def tool_client_id(broker: BrokerSettings, purpose: str) -> str:
    """`<account>-<purpose>-<random>`, or `pfl-<purpose>-<random>` on a broker without accounts.

    The embedded broker admits a tool only with ids that start with its account's name; a broker
    that binds client ids to user names (the provisioned mosquitto) uses the account's name
    itself, so each tool needs an account of its own (`protocols.access.TOOL_USERS`).

    Raises:
        ToolAccountError: `broker` logs in as the coordinator: on a broker that binds ids to
            names, the tool would disconnect the running coordinator.
    """
    suffix = f"{purpose}-{uuid.uuid4().hex[:12]}"
    username = broker.username
    if username == COORDINATOR_USER:
        msg = (
            f"{COORDINATOR_USER} is the coordinator's account: logged in with it, "
            f"`pfl-coord {purpose}` would disconnect a running `serve`. Use the tool's own "
            "account: viewer.env for status, dashboard.env for dashboard, operator.env for export"
        )
        raise ToolAccountError(msg)
    if username and username.startswith(topics.RESERVED_PREFIX):
        return f"{username}-{suffix}"
    return f"{topics.RESERVED_PREFIX}{suffix}"
