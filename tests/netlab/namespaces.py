"""Network namespaces joined to the host by a veth pair, each direction shaped by a tbf qdisc.

What the fault proxy cannot do from user space, the kernel does here: a device's process runs
inside its own namespace (`run`) and reaches the host only through the veth pair, whose egress
on either side is capped by a token bucket (`tbf`; this kernel has no `netem`, so latency and
loss stay with the proxy). Addresses are 10.231.<slot>.1 (host) and .2 (namespace), nothing
routes further. Creating namespaces needs privileges: `unavailable()` says why it cannot.
"""

from __future__ import annotations

import os
import subprocess
from typing import Final

_PREFIX: Final = "pflnet"


def _ip(*args: str, namespace: str | None = None) -> None:
    _run(["ip", *args], namespace)


def _tc(*args: str, namespace: str | None = None) -> None:
    _run(["tc", *args], namespace)


def _run(command: list[str], namespace: str | None) -> None:
    inside = [] if namespace is None else ["ip", "netns", "exec", namespace]
    subprocess.run([*inside, *command], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces with shaped veth pairs cannot be made here; None when they can."""
    probe = f"{_PREFIX}-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError as error:
        return f"no `ip` command: {error}"
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` failed (needs root or CAP_SYS_ADMIN): {error.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class ShapedNamespace:
    """One namespace, its veth pair and the rates each way (kbit/s); a context manager."""

    def __init__(self, slot: int, up_kbit: int, down_kbit: int) -> None:
        self.name = f"{_PREFIX}-{os.getpid()}-{slot}"
        self.host_link = f"pflh{os.getpid() % 10000}s{slot}"
        self.inner_link = f"pfli{os.getpid() % 10000}s{slot}"
        self.host_address = f"10.231.{slot}.1"
        self.address = f"10.231.{slot}.2"
        self.up_kbit = up_kbit
        self.down_kbit = down_kbit

    def __enter__(self) -> ShapedNamespace:
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.inner_link)
            _ip("link", "set", self.inner_link, "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
            _ip("addr", "add", f"{self.address}/30", "dev", self.inner_link, namespace=self.name)
            _ip("link", "set", self.inner_link, "up", namespace=self.name)
            _ip("link", "set", "lo", "up", namespace=self.name)
            # egress from the host is the device's downlink, egress from the namespace its uplink
            self._shape(self.host_link, self.down_kbit, None)
            self._shape(self.inner_link, self.up_kbit, self.name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, timeout=30)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    @staticmethod
    def _shape(link: str, kbit: int, namespace: str | None) -> None:
        burst = max(4, kbit // 80)  # about 12 ms worth of bytes, at least 4 kbit (one MTU)
        _tc(
            "qdisc", "add", "dev", link, "root", "tbf", "rate", f"{kbit}kbit",
            "burst", f"{burst}kbit", "latency", "400ms", namespace=namespace,
        )  # fmt: skip
