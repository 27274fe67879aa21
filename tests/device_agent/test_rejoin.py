"""A started agent says hello again after every reconnect; shared agents do so one at a time."""

from __future__ import annotations

import threading

from device_agent.virtual_fleet import SerializedTransport
from protocols import topics
from protocols.codec import decode_frame
from protocols.messages import DeviceHello
from protocols.transport.base import ReconnectHook
from protocols.transport.inprocess import InProcessBroker, InProcessTransport
from tests.hub_fleet import hub_agents


class Reconnectable(InProcessTransport):
    """An in-process client whose reconnects the test makes happen; notes if `lock` is held."""

    def __init__(self, broker: InProcessBroker, client_id: str, lock: threading.Lock) -> None:
        super().__init__(broker, client_id, None)
        self.hook: ReconnectHook | None = None
        self.lock = lock
        self.locked: list[bool] = []

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        self.hook = hook

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.locked.append(self.lock.locked())
        super().publish(topic, payload, retain=retain)

    def reconnect(self) -> None:
        assert self.hook is not None, "the agent registered no reconnect hook"
        self.hook()


def test_a_started_agent_says_hello_again_after_a_reconnect_under_the_shared_lock() -> None:
    # Prepare: one device on a transport that agents sharing a workspace serialize
    broker = InProcessBroker()
    coordinator = broker.connect("coordinator")
    hellos: list[str] = []

    def on_hello(topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        assert isinstance(message, DeviceHello)
        hellos.append(message.device_id)

    coordinator.subscribe(topics.device_subscription("default", "hello"), on_hello)
    inner = Reconnectable(broker, "dev-0", threading.Lock())
    hub_agents(broker, ["dev-0"], lambda i: {"transport": SerializedTransport(inner, inner.lock)})
    coordinator.wait_until(lambda: len(hellos) == 1, timeout_s=1)
    published_at_start = len(inner.locked)

    # Execute
    inner.reconnect()
    coordinator.wait_until(lambda: len(hellos) == 2, timeout_s=1)

    # Assert: the reconnect said hello (and "online") again, all of it under the lock
    assert hellos == ["dev-0", "dev-0"]
    assert inner.locked[:published_at_start] == [False] * published_at_start
    assert inner.locked[published_at_start:] == [True, True]
