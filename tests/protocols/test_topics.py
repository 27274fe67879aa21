"""Tests for the topic layout: builders and parser agree, bad topics fail, MQTT matching holds."""

from __future__ import annotations

from typing import get_args

import pytest

from protocols import topics
from protocols.errors import ProtocolError
from protocols.topics import DeviceTopicKind, TopicRef, parse_topic, topic_matches

FLEET = "lab-1"
DEVICE = "pi.3_a"
DEVICE_TOPIC_KINDS: tuple[DeviceTopicKind, ...] = get_args(DeviceTopicKind)


def built_topics() -> list[tuple[str, TopicRef]]:
    fleet_topics = [
        (topics.coordinator_status(FLEET), TopicRef(FLEET, "coordinator-status")),
        (topics.fleet_status(FLEET), TopicRef(FLEET, "fleet-status")),
        (topics.fleet_row(FLEET, DEVICE), TopicRef(FLEET, "fleet-row", DEVICE)),
        (topics.round_announcement(FLEET), TopicRef(FLEET, "round")),
        (topics.shared_model(FLEET), TopicRef(FLEET, "model")),
        (topics.command(FLEET, DEVICE), TopicRef(FLEET, "command", DEVICE)),
        (topics.command(FLEET), TopicRef(FLEET, "command", topics.BROADCAST)),
    ]
    device_topics = [
        (topics.device(FLEET, DEVICE, kind), TopicRef(FLEET, kind, DEVICE))
        for kind in DEVICE_TOPIC_KINDS
    ]
    return fleet_topics + device_topics


@pytest.mark.parametrize(("topic", "ref"), built_topics(), ids=lambda value: str(value))
def test_parse_topic_inverts_every_builder(topic: str, ref: TopicRef) -> None:
    # Execute
    parsed = parse_topic(topic)

    # Assert
    assert parsed == ref
    assert topic.startswith(f"pfl/{FLEET}/")


def test_device_topic_kinds_match_the_published_tuple() -> None:
    # Assert
    assert DEVICE_TOPIC_KINDS == topics.DEVICE_TOPIC_KINDS


def test_every_kind_has_a_distinct_topic() -> None:
    # Execute
    built = [topic for topic, _ in built_topics()]

    # Assert
    assert len(set(built)) == len(built)
    assert {ref.kind for _, ref in built_topics()} == {
        "coordinator-status",
        "fleet-status",
        "fleet-row",
        "round",
        "model",
        "command",
        *DEVICE_TOPIC_KINDS,
    }


def test_layout_matches_the_documented_one() -> None:
    # Assert: the docstring is what docs/protocol.md shows, so it must name real topics
    assert topics.coordinator_status("f") == "pfl/f/coordinator/status"
    assert topics.round_announcement("f") == "pfl/f/round"
    assert topics.shared_model("f") == "pfl/f/model"
    assert topics.command("f", "d") == "pfl/f/command/d"
    assert topics.command("f") == "pfl/f/command/all"
    for kind in DEVICE_TOPIC_KINDS:
        topic = f"pfl/<fleet>/device/<device>/{kind}"
        assert topic in (topics.__doc__ or "")
        assert topics.device("f", "d", kind) == f"pfl/f/device/d/{kind}"


@pytest.mark.parametrize(
    "topic",
    [
        "",
        "pfl",
        "pfl/lab",
        "other/lab/round",
        "PFL/lab/round",
        "/pfl/lab/round",
        "pfl/lab/round/",
        "pfl/lab/rounds",
        "pfl/lab/model/extra",
        "pfl/lab/coordinator",
        "pfl/lab/coordinator/state",
        "pfl/lab/command",
        "pfl/lab/command/pi-3/extra",
        "pfl/lab/device/pi-3",
        "pfl/lab/device/pi-3/weights",
        "pfl/lab/device/pi-3/update/extra",
        "pfl/lab/device/pi-3/#",
    ],
)
def test_parse_topic_rejects_foreign_and_unknown_topics(topic: str) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="topic") as caught:
        parse_topic(topic)
    assert caught.value.topic == topic


@pytest.mark.parametrize(
    ("topic", "complaint"),
    [
        ("pfl//round", "invalid fleet"),
        ("pfl/l+b/round", "invalid fleet"),
        ("pfl/#/model", "invalid fleet"),
        ("pfl/-lab/model", "invalid fleet"),
        (f"pfl/{'f' * 65}/model", "invalid fleet"),
        ("pfl/lab/command/+", "invalid device id"),
        ("pfl/lab/command/", "invalid device id"),
        ("pfl/lab/device/+/update", "invalid device id"),
        ("pfl/lab/coordinator/fleet/+", "invalid device id"),
        ("pfl/lab/coordinator/fleet/all", "reserved"),
        ("pfl/lab/device//hello", "invalid device id"),
        ("pfl/lab/device/p#/status", "invalid device id"),
        (f"pfl/lab/device/{'d' * 65}/status", "invalid device id"),
    ],
)
def test_parse_topic_rejects_bad_segments(topic: str, complaint: str) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match=complaint):
        parse_topic(topic)


@pytest.mark.parametrize("bad", ["", "a/b", "a+", "#", "with space", "x" * 65, ".dot"])
def test_builders_reject_bad_segments(bad: str) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="invalid fleet"):
        topics.shared_model(bad)
    with pytest.raises(ProtocolError, match="invalid device id"):
        topics.device(FLEET, bad, "update")
    with pytest.raises(ProtocolError, match="invalid device id"):
        topics.command(FLEET, bad)
    with pytest.raises(ProtocolError, match="invalid device id"):
        topics.device_subtree(FLEET, bad)


def test_device_rejects_unknown_kind_naming_the_valid_ones() -> None:
    # Execute / Assert
    with pytest.raises(
        ProtocolError, match="unknown device topic 'weights'; expected one of hello"
    ):
        topics.device(FLEET, DEVICE, "weights")


@pytest.mark.parametrize(
    ("pattern", "topic", "matches"),
    [
        ("a/b/c", "a/b/c", True),
        ("a/b/c", "a/b/d", False),
        ("a/b/c", "a/b", False),
        ("a/b", "a/b/c", False),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a/x/y/c", False),
        ("a/+", "a/x", True),
        ("a/+", "a", False),
        ("a/+", "a/x/y", False),
        ("+", "a", True),
        ("+", "a/b", False),
        ("+/+", "a/b", True),
        ("+/b", "/b", True),
        ("a/+/c", "a//c", True),
        ("a/#", "a/b/c/d", True),
        ("a/#", "a/b", True),
        ("a/#", "a", True),
        ("a/#", "b/a", False),
        ("a/b/#", "a/c/d", False),
        ("#", "a/b/c", True),
        ("#", "a", True),
        ("+/b/#", "a/b", True),
        ("+/b/#", "a/c/d", False),
        ("A/b", "a/b", False),
    ],
)
def test_topic_matches_follows_mqtt_semantics(pattern: str, topic: str, matches: bool) -> None:
    # Execute / Assert
    assert topic_matches(pattern, topic) is matches


def test_coordinator_subscriptions_match_every_device_but_only_their_kind() -> None:
    # Prepare
    pattern = topics.device_subscription(FLEET, "update")

    # Execute / Assert
    assert topic_matches(pattern, topics.device(FLEET, "pi-1", "update"))
    assert topic_matches(pattern, topics.device(FLEET, "pi-2", "update"))
    assert not topic_matches(pattern, topics.device(FLEET, "pi-1", "hello"))
    assert not topic_matches(pattern, topics.device("other", "pi-1", "update"))


def test_device_subtree_covers_only_that_devices_topics() -> None:
    # Prepare
    subtree = topics.device_subtree(FLEET, DEVICE)

    # Execute
    own = [topics.device(FLEET, DEVICE, kind) for kind in DEVICE_TOPIC_KINDS]
    foreign = [
        topics.device(FLEET, "pi-4", "update"),
        topics.device(FLEET, f"{DEVICE}x", "update"),
        topics.command(FLEET, DEVICE),
        topics.shared_model(FLEET),
        topics.round_announcement(FLEET),
        topics.coordinator_status(FLEET),
    ]

    # Assert
    assert all(topic_matches(subtree, topic) for topic in own)
    assert not any(topic_matches(subtree, topic) for topic in foreign)


def test_chunk_topics_parse_back_and_others_do_not() -> None:
    base = topics.shared_model(FLEET)
    assert topics.chunk_topic(base, 12) == f"{base}/chunk/12"
    assert topics.parse_chunk_topic(topics.chunk_topic(base, 12)) == (base, 12)
    assert topics.parse_chunk_topic(base) is None
    assert topics.parse_chunk_topic("chunk/1") is None
    assert topics.parse_chunk_topic("a/chunk/x") is None


def test_chunk_subscription_matches_every_chunk_of_the_pattern_only() -> None:
    pattern = topics.device_subscription(FLEET, "update")
    chunk = topics.chunk_topic(topics.device(FLEET, DEVICE, "update"), 3)
    assert topic_matches(topics.chunk_subscription(pattern), chunk)
    assert not topic_matches(
        topics.chunk_subscription(pattern), topics.device(FLEET, DEVICE, "update")
    )
    assert not topic_matches(pattern, chunk)


def test_a_device_reads_its_own_and_the_fleets_topics_but_no_other_devices() -> None:
    readable = topics.device_readable(FLEET, DEVICE)
    assert {parse_topic(topic).kind for topic in readable} == {
        "coordinator-status",
        "fleet-status",
        "round",
        "model",
        "model-delta",
        "command",
        "relay",
        "secure",
    }
    assert {parse_topic(topic).device_id for topic in readable} == {None, DEVICE, topics.BROADCAST}
    assert topics.relay(FLEET, "other") not in readable
    assert topics.secure(FLEET, "other") not in readable
    assert all(topic_matches(topics.fleet_subtree(FLEET), topic) for topic in readable)
    assert not topic_matches(topics.fleet_subtree(FLEET), topics.shared_model("other-fleet"))
