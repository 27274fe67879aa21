"""When a round may close: everyone answered, or every online device did and the quorum holds."""

from __future__ import annotations

from coordinator.intake import Collector


def test_a_round_waits_for_online_devices_and_the_quorum() -> None:
    # Prepare
    collector: Collector[int] = Collector(1, "train", {"a", "b", "c"})
    collector.offer("a", 1)
    # Assert: b is online and silent, so wait; once b is offline, a alone misses quorum 2
    assert not collector.settled({"a", "b"}, needed=2)
    assert not collector.settled({"a"}, needed=2)
    collector.offer("b", 2)
    assert collector.settled({"a", "b"}, needed=2)  # c is offline: no need to wait for it
    assert not collector.settled({"a", "b", "c"}, needed=2)  # c online: it may still answer
    collector.offer("c", 3)
    assert collector.settled(set(), needed=3)


def test_duplicates_and_strangers_are_not_counted() -> None:
    collector: Collector[int] = Collector(1, "train", {"a"})
    assert collector.offer("a", 1)
    assert not collector.offer("a", 2)
    assert not collector.offer("z", 3)
    assert collector.sorted_answers() == [1]
