"""When a round may close: nobody is left to wait for; enough answers is the engine's question.

Nobody is left once each asked device answered, declined or went offline.
"""

from __future__ import annotations

from coordinator.engine.intake import Collector


def test_a_round_waits_only_for_online_devices_that_have_not_answered() -> None:
    # Prepare
    collector: Collector[int] = Collector(1, "train", {"a", "b", "c"})
    collector.offer("a", 1)
    # Assert: b is online and silent, so wait; once b and c are offline nobody is left
    assert not collector.settled({"a", "b"})
    assert collector.settled({"a"})
    collector.offer("b", 2)
    assert collector.settled({"a", "b"})  # c is offline: no need to wait for it
    assert not collector.settled({"a", "b", "c"})  # c online: it may still answer
    collector.offer("c", 3)
    assert collector.settled(set())


def test_a_round_every_asked_device_declined_or_left_is_settled_at_once() -> None:
    collector: Collector[int] = Collector(1, "train", {"a", "b", "c"})
    assert not collector.settled({"a", "b", "c"})
    collector.decline("a")
    collector.decline("b")
    assert not collector.settled({"a", "b", "c"})  # c online and silent
    assert collector.settled({"a", "b"})  # c went offline (its last will)
    collector.decline("c")
    assert collector.settled({"a", "b", "c"})
    assert collector.sorted_answers() == []


def test_duplicates_and_strangers_are_not_counted() -> None:
    collector: Collector[int] = Collector(1, "train", {"a"})
    assert collector.offer("a", 1)
    assert not collector.offer("a", 2)
    assert not collector.offer("z", 3)
    assert collector.sorted_answers() == [1]
