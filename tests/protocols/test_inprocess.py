"""The in-process hub: wildcard matches it remembers follow the subscriptions as they change."""

from __future__ import annotations

from protocols.transport.inprocess import InProcessBroker


def test_wildcard_subscriptions_made_or_dropped_between_messages_are_honoured() -> None:
    # Prepare: one topic delivered before, between and after wildcard changes
    hub = InProcessBroker()
    sender = hub.connect("sender")
    first, second = hub.connect("first"), hub.connect("second")
    got: dict[str, list[bytes]] = {"first": [], "second": []}
    first.subscribe("pfl/f/device/+/update", lambda _, payload: got["first"].append(payload))
    topic = "pfl/f/device/d1/update"

    # Execute
    sender.publish(topic, b"1")
    hub.pump(lambda: False)
    second.subscribe("pfl/f/#", lambda _, payload: got["second"].append(payload))
    sender.publish(topic, b"2")
    hub.pump(lambda: False)
    first.unsubscribe("pfl/f/device/+/update")
    sender.publish(topic, b"3")
    hub.pump(lambda: False)

    # Assert
    assert got == {"first": [b"1", b"2"], "second": [b"2", b"3"]}
