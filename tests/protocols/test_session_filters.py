"""Which filters a transport subscribes to again after a reconnect."""

from __future__ import annotations

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from protocols.transport.subscriptions import SessionFilters

GRANTED = ReasonCode(PacketTypes.SUBACK, identifier=1)
REFUSED = ReasonCode(PacketTypes.SUBACK, identifier=0x80)


def test_a_kept_session_is_asked_only_for_what_it_never_acknowledged() -> None:
    filters = SessionFilters()
    assert filters.add(["a", "a/chunk/+"]) == ["a", "a/chunk/+"]
    filters.confirmed(["a", "a/chunk/+"])
    assert filters.add(["a", "b"]) == ["b"]  # subscribed while disconnected: never acked

    assert filters.to_resubscribe(session_present=True) == ["b"]
    assert filters.to_resubscribe(session_present=False) == ["a", "a/chunk/+", "b"]


def test_a_resubscription_is_confirmed_by_its_suback_filter_by_filter() -> None:
    filters = SessionFilters()
    filters.add(["a", "b"])
    filters.resubscribing(7, ["a", "b"])

    assert not filters.acknowledged(8, [GRANTED])  # someone else's SUBACK
    assert filters.acknowledged(7, [GRANTED, REFUSED])
    assert filters.to_resubscribe(session_present=True) == ["b"]


def test_removed_filters_are_not_subscribed_again() -> None:
    filters = SessionFilters()
    filters.add(["a", "b"])
    filters.remove(["a"])

    assert filters.to_resubscribe(session_present=False) == ["b"]
    assert filters.add(["a"]) == ["a"]
