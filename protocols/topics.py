"""The topic layout, written down once: builders for every topic and one parser for inbound ones.

    pfl/<fleet>/coordinator/status          retained, last-will "offline"     coordinator -> all
    pfl/<fleet>/coordinator/fleet           retained FleetSummary, every round coordinator -> all
    pfl/<fleet>/coordinator/fleet/<device>  retained FleetRow, when it changed coordinator -> ops
    pfl/<fleet>/coordinator/history         retained RunHistory, every round   coordinator -> ops
    pfl/<fleet>/round                       retained RoundAnnouncement         coordinator -> all
    pfl/<fleet>/model                       retained SharedModel + tensors     coordinator -> asked
    pfl/<fleet>/model-delta                 retained ModelDelta (int8 downlink) coordinator -> asked
    pfl/<fleet>/command/<device>            Command (or "all" for every one)   coordinator -> device
    pfl/<fleet>/relay/<device>              PeerModels + models (FedeRiCo)     coordinator -> device
    pfl/<fleet>/secure/<device>             SecAggInbox (secure aggregation)   coordinator -> device
    pfl/<fleet>/secure/all                  SecAggRoster, SecAggUnmask         coordinator -> asked
    pfl/<fleet>/device/<device>/hello       DeviceHello                        device -> coordinator
    pfl/<fleet>/device/<device>/status      retained, last-will "offline"      device -> all
    pfl/<fleet>/device/<device>/update      DeviceUpdate + shared delta        device -> coordinator
    pfl/<fleet>/device/<device>/request     PeerRequest (FedeRiCo)             device -> coordinator
    pfl/<fleet>/device/<device>/evaluation  EvaluationReport                   device -> coordinator
    pfl/<fleet>/device/<device>/export-report ExportReport                     device -> coordinator
    pfl/<fleet>/device/<device>/secagg      SecAggKeys, -Shares, -Reveal       device -> coordinator
    <any topic above>/chunk/<index>         one chunk of a payload too large for one message

A device publishes only under its own `device/<id>/` subtree; everything else is the coordinator's.
A device subscribes to `model` (or `model-delta`) only while it needs a model it does not hold.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Final, Literal, get_args

from protocols.errors import ProtocolError

ROOT: Final = "pfl"
BROADCAST: Final = "all"
RESERVED_PREFIX: Final = "pfl-"
"""The coordinator's and the operator commands' broker accounts and client ids start with it."""
DeviceTopicKind = Literal[
    "hello", "status", "update", "request", "evaluation", "export-report", "secagg"
]
FleetTopicKind = Literal[
    "coordinator-status",
    "fleet-status",
    "fleet-row",
    "run-history",
    "round",
    "model",
    "model-delta",
    "command",
    "relay",
    "secure",
]
DEVICE_TOPIC_KINDS: Final[tuple[str, ...]] = get_args(DeviceTopicKind)
CHUNK_SEGMENT: Final = "chunk"
_CACHED_TOPICS: Final = 1 << 16
"""Topics built or parsed per message are remembered (valid ones only): they recur every round."""
_SEGMENT: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _segment(value: str, what: str) -> str:
    if not _SEGMENT.match(value):
        msg = f"invalid {what} {value!r}: use letters, digits, '_', '.', '-' (at most 64)"
        raise ProtocolError(msg)
    return value


def device_id_problem(device_id: str) -> str | None:
    """Why `device_id` cannot name a device, or None.

    Besides the topic-segment rule, `all` is the broadcast command topic's last segment and
    `pfl-...` names the coordinator's and operators' accounts: a device with such an id would
    receive every device's commands or could take over the coordinator's MQTT session.
    """
    if not _SEGMENT.match(device_id):
        return f"invalid device id {device_id!r}: use letters, digits, '_', '.', '-' (at most 64)"
    if device_id == BROADCAST:
        return f"device id {BROADCAST!r} is reserved: it addresses every device"
    if device_id.lower().startswith(RESERVED_PREFIX):
        return (
            f"device id {device_id!r} is reserved: ids starting with {RESERVED_PREFIX!r} belong "
            "to the coordinator and operator accounts"
        )
    return None


def _device_segment(device_id: str) -> str:
    problem = device_id_problem(device_id)
    if problem is not None:
        raise ProtocolError(problem)
    return device_id


def coordinator_status(fleet: str) -> str:
    """Retained coordinator liveness."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/coordinator/status"


def fleet_status(fleet: str) -> str:
    """Retained summary of the fleet (counts), refreshed after each round."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/coordinator/fleet"


def fleet_row(fleet: str, device_id: str | None = None) -> str:
    """One device's retained row of the fleet status (None: the filter matching every row)."""
    device = "+" if device_id is None else _device_segment(device_id)
    return f"{fleet_status(fleet)}/{device}"


def run_history(fleet: str) -> str:
    """Retained history of the run (rounds, per-device results) for dashboards, not devices."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/coordinator/history"


def round_announcement(fleet: str) -> str:
    """Retained announcement of the current round."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/round"


def shared_model(fleet: str) -> str:
    """Retained shared model."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/model"


def model_delta(fleet: str) -> str:
    """Retained int8 delta from the previous shared model to the current one."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/model-delta"


def aggregator_status(fleet: str, aggregator: str = "+") -> str:
    """Retained status of one aggregator of the tier (every aggregator's with the default)."""
    segment = aggregator if aggregator == "+" else _segment(aggregator, "aggregator")
    return f"{ROOT}/{_segment(fleet, 'fleet')}/tier/{segment}/status"


def command(fleet: str, device_id: str = BROADCAST) -> str:
    """Commands for one device, or for every device with the default."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/command/{_segment(device_id, 'device id')}"


def command_subscription(fleet: str) -> str:
    """Every command topic: one device's or the broadcast one (for ACLs)."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/command/+"


def relay(fleet: str, device_id: str) -> str:
    """The models the coordinator relays to one device (FedeRiCo); only that device reads it."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/relay/{_device_segment(device_id)}"


def secure(fleet: str, device_id: str = BROADCAST) -> str:
    """Secure aggregation's messages to one device (its inbox), or to all selected ones."""
    segment = BROADCAST if device_id == BROADCAST else _device_segment(device_id)
    return f"{ROOT}/{_segment(fleet, 'fleet')}/secure/{segment}"


@functools.lru_cache(maxsize=_CACHED_TOPICS)
def device(fleet: str, device_id: str, kind: DeviceTopicKind) -> str:
    """A topic in a device's own subtree."""
    if kind not in DEVICE_TOPIC_KINDS:
        msg = f"unknown device topic {kind!r}; expected one of {', '.join(DEVICE_TOPIC_KINDS)}"
        raise ProtocolError(msg)
    return f"{ROOT}/{_segment(fleet, 'fleet')}/device/{_device_segment(device_id)}/{kind}"


def device_subscription(fleet: str, kind: DeviceTopicKind) -> str:
    """The wildcard the coordinator subscribes to for one kind of device message."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/device/+/{kind}"


def device_subtree(fleet: str, device_id: str) -> str:
    """Everything a device may publish to (for ACLs)."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/device/{_device_segment(device_id)}/#"


def fleet_subtree(fleet: str) -> str:
    """Every topic of a fleet: what the coordinator may publish and read (for ACLs)."""
    return f"{ROOT}/{_segment(fleet, 'fleet')}/#"


def device_readable(fleet: str, device_id: str) -> tuple[str, ...]:
    """The coordinator's topics one device may read (for ACLs), without their chunk topics.

    Its own command and relay topics, then what every device reads; never another's relay.
    """
    return (
        command(fleet, device_id),
        relay(fleet, device_id),
        secure(fleet, device_id),
        secure(fleet),
        coordinator_status(fleet),
        fleet_status(fleet),
        round_announcement(fleet),
        shared_model(fleet),
        model_delta(fleet),
        command(fleet),
    )


def operator_readable(fleet: str) -> tuple[str, ...]:
    """What `pfl-coord status`, `dashboard` and `export` read (ACLs): never models or updates."""
    return (
        coordinator_status(fleet),
        fleet_status(fleet),
        fleet_row(fleet),
        run_history(fleet),
        device_subscription(fleet, "status"),
        device_subscription(fleet, "export-report"),
        aggregator_status(fleet),
    )


def chunk_topic(topic: str, index: int) -> str:
    """The topic chunk `index` of a large payload for `topic` travels on."""
    return f"{topic}/{CHUNK_SEGMENT}/{index}"


def chunk_subscription(pattern: str) -> str:
    """The filter matching every chunk topic of the topics `pattern` matches."""
    return f"{pattern}/{CHUNK_SEGMENT}/+"


def parse_chunk_topic(topic: str) -> tuple[str, int] | None:
    """Split a chunk topic into (base topic, index); None for any other topic."""
    base, _, index = topic.rpartition("/")
    base, _, segment = base.rpartition("/")
    if segment != CHUNK_SEGMENT or not base or not index.isdigit():
        return None
    return base, int(index)


@dataclass(frozen=True)
class TopicRef:
    """A parsed inbound topic: which fleet, what kind, and for device topics which device."""

    fleet: str
    kind: str
    device_id: str | None = None


@functools.lru_cache(maxsize=_CACHED_TOPICS)
def parse_topic(topic: str) -> TopicRef:
    """Turn an inbound topic into a typed reference.

    Raises:
        ProtocolError: the topic is not one this layout defines.
    """
    parts = topic.split("/")
    if len(parts) < 3 or parts[0] != ROOT:
        msg = f"not a pfl-edge topic: {topic!r}"
        raise ProtocolError(msg, topic=topic)
    fleet = _segment(parts[1], "fleet")
    rest = parts[2:]
    if rest == ["coordinator", "status"]:
        return TopicRef(fleet, "coordinator-status")
    if rest == ["coordinator", "fleet"]:
        return TopicRef(fleet, "fleet-status")
    if len(rest) == 3 and rest[:2] == ["coordinator", "fleet"]:
        return TopicRef(fleet, "fleet-row", _device_segment(rest[2]))
    if rest == ["coordinator", "history"]:
        return TopicRef(fleet, "run-history")
    if rest in (["round"], ["model"], ["model-delta"]):
        return TopicRef(fleet, rest[0])
    if len(rest) == 2 and rest[0] == "command":
        return TopicRef(fleet, rest[0], _segment(rest[1], "device id"))
    if len(rest) == 2 and rest[0] == "relay":
        return TopicRef(fleet, rest[0], _device_segment(rest[1]))
    if len(rest) == 2 and rest[0] == "secure":
        recipient = rest[1] if rest[1] == BROADCAST else _device_segment(rest[1])
        return TopicRef(fleet, rest[0], recipient)
    if len(rest) == 3 and rest[0] == "device" and rest[2] in DEVICE_TOPIC_KINDS:
        return TopicRef(fleet, rest[2], _device_segment(rest[1]))
    msg = f"unknown pfl-edge topic: {topic!r}"
    raise ProtocolError(msg, topic=topic)


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT wildcard matching (`+` one level, `#` the rest), as a broker applies it."""
    pattern_parts = pattern.split("/")
    topic_parts = topic.split("/")
    for index, part in enumerate(pattern_parts):
        if part == "#":
            return True
        if index >= len(topic_parts) or (part != "+" and part != topic_parts[index]):
            return False
    return len(pattern_parts) == len(topic_parts)
