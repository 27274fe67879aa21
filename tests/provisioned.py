"""A mosquitto started from `pfl-coord provision`'s own files (TLS, passwords, ACL)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from coordinator.ops.provision import Credential, ProvisionResult, provision
from protocols.transport.settings import BrokerSettings
from tests.conftest import free_port, mosquitto_binary, wait_for_port


class ProvisionedBroker:
    """mosquitto started from the generated mosquitto.conf, on free loopback ports."""

    def __init__(self, result: ProvisionResult, tls_port: int, plain_port: int) -> None:
        self.result = result
        self.tls_port = tls_port
        self.plain_port = plain_port
        self.log = result.directory / "mosquitto.log"
        config = result.files["mosquitto.conf"].read_text()
        # As root, mosquitto would drop to its own user, who cannot read pytest's 0700 tmp dirs.
        config += "user root\n" if os.geteuid() == 0 else ""
        config += "persistence false\nlog_dest stderr\nlog_type all\n"
        self.config = result.directory / "mosquitto-test.conf"
        self.config.write_text(config)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [mosquitto_binary(), "-c", str(self.config)], stdout=subprocess.DEVNULL, stderr=log
            )
        if not (wait_for_port(tls_port) and wait_for_port(plain_port)):
            self.stop()
            pytest.fail(f"provisioned mosquitto did not start; its log:\n{self.log.read_text()}")

    @property
    def url(self) -> str:
        """The TLS listener's URL."""
        return f"mqtts://127.0.0.1:{self.tls_port}"

    def coordinator_options(self) -> dict[str, Any]:
        """Run settings that reach this broker as its provisioned coordinator, over TLS."""
        credential = self.account("coordinator")
        return {
            "broker": self.url,
            "username": credential.username,
            "password": credential.password,
            "ca_file": str(self.result.files["ca.crt"]),
        }

    def account(self, user: str) -> Credential:
        """The credential of "coordinator", "operator" or a device id."""
        result = self.result
        named = {"coordinator": result.coordinator, "operator": result.operator}
        return named.get(user) or result.devices[user]

    def settings(self, username: str | None, password: str | None, **extra: Any) -> BrokerSettings:
        """Settings for the TLS listener with the generated CA."""
        return BrokerSettings(
            url=self.url,
            ca_file=str(self.result.files["ca.crt"]),
            username=username,
            password=password,
            connect_timeout_s=5,
            **extra,
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def start_provisioned(
    directory: Path, devices: Sequence[str], fleet: str, **options: Any
) -> ProvisionedBroker:
    """Provision `devices` into `directory` and start mosquitto on free loopback ports."""
    tls_port, plain_port = free_port(), free_port()
    result = provision(
        devices,
        directory,
        fleet=fleet,
        host="127.0.0.1",
        tls_port=tls_port,
        plain_port=plain_port,
        **options,
    )
    return ProvisionedBroker(result, tls_port, plain_port)
