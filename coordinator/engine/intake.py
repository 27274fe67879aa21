"""What a device's message must satisfy before the engine acts on it, and where answers gather.

Every check raises a `PflError` naming the device: the engine's guarded handlers turn that into
one dropped, counted message. Nothing here touches the network or the model.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Generic, TypeVar

from protocols import topics
from protocols.codec import Tensors, decode_frame, unpack_tensors
from protocols.compression import decode, encoded_layout
from protocols.errors import ProtocolError, RoundError
from protocols.messages import (
    Compression,
    DeviceHello,
    DeviceUpdate,
    EvaluationReport,
    Message,
    PeerRequest,
    TensorSpec,
)

Answer = TypeVar("Answer")
Expected = TypeVar("Expected", bound=Message)
RunAnswer = DeviceUpdate | PeerRequest | EvaluationReport


class Collector(Generic[Answer]):
    """Answers for one (round, phase) from the devices asked; first answer per device wins."""

    def __init__(self, round_id: int, phase: str, expected: set[str]) -> None:
        self.round_id = round_id
        self.phase = phase
        self.expected = expected
        self.answers: dict[str, Answer] = {}
        self.declined: set[str] = set()
        self._lock = threading.Lock()
        self._online_seen: AbstractSet[str] | None = None
        self._expected_online = 0

    def decline(self, device_id: str) -> None:
        """A device will not answer (it is on battery, failed, or is quarantined): stop waiting."""
        with self._lock:
            if device_id in self.expected and device_id not in self.answers:
                self.declined.add(device_id)

    def offer(self, device_id: str, answer: Answer) -> bool:
        """Take a device's first answer; False for a duplicate or a device not asked."""
        with self._lock:
            if device_id not in self.expected or device_id in self.answers:
                return False
            self.answers[device_id] = answer
            return True

    def asks(self, device_id: str, round_id: int) -> bool:
        """Whether an answer from `device_id` for `round_id` belongs here (not stale)."""
        return round_id == self.round_id

    def outstanding(self, online: AbstractSet[str]) -> set[str]:
        """The asked devices in `online` that have neither answered nor declined."""
        with self._lock:
            return (self.expected & online) - self.answers.keys() - self.declined

    def complete(self) -> bool:
        """Every asked device answered."""
        with self._lock:
            return len(self.answers) >= len(self.expected)

    def settled(self, online: AbstractSet[str]) -> bool:
        """Nobody is left to wait for: each asked device answered, declined or went offline.

        Whether enough answered is the caller's question: when no asked device can answer
        (all declined or offline), the round ends now rather than at its deadline.
        """
        with self._lock:
            if len(self.answers) >= len(self.expected):
                return True
            if online is not self._online_seen:  # the registry hands out a new set on change
                self._online_seen, self._expected_online = online, len(self.expected & online)
            if len(self.answers) + len(self.declined) < self._expected_online:
                return False  # someone online must still be waited for: the common case
            return not (self.expected & online) - set(self.answers) - self.declined

    def sorted_answers(self) -> list[Answer]:
        """The answers in device-id order (deterministic aggregation)."""
        with self._lock:
            return [self.answers[key] for key in sorted(self.answers)]


def device_message(topic: str, payload: bytes, expected: type[Expected]) -> tuple[Expected, bytes]:
    """Decode a frame from a device topic: the expected kind, sent by the topic's device.

    Raises:
        ProtocolError: malformed, another kind, or a device id other than the topic's.
    """
    reference = topics.parse_topic(topic)
    message, blob = decode_frame(payload)
    if not isinstance(message, expected):
        msg = f"expected {expected.__name__}, got {message.kind}"
        raise ProtocolError(msg, topic=topic)
    if getattr(message, "device_id", None) != reference.device_id:
        msg = f"device id {getattr(message, 'device_id', None)!r} does not match its topic"
        raise ProtocolError(msg, device_id=reference.device_id, topic=topic)
    return message, blob


def check_hello(hello: DeviceHello, task: str, max_samples: int, topic: str) -> None:
    """A device may join only for the fleet's task and with a believable data set.

    Raises:
        RoundError: another task.
        ProtocolError: more training samples than `max_samples`.
    """
    if task and hello.task != task:
        msg = f"device runs task {hello.task!r}, the fleet runs {task!r}"
        raise RoundError(msg, device_id=hello.device_id, topic=topic)
    if hello.num_train_samples > max_samples:
        msg = f"declares {hello.num_train_samples} training samples, over the limit {max_samples}"
        raise ProtocolError(msg, device_id=hello.device_id, topic=topic)


def check_claims(update: DeviceUpdate, algorithm: str, declared: int | None, topic: str) -> None:
    """An update speaks for the fleet's algorithm and at most the samples its hello declared.

    Raises:
        ProtocolError: another algorithm, an unknown device, or more samples than declared.
    """
    if update.algorithm != algorithm:
        msg = f"update from algorithm {update.algorithm!r}, the fleet runs {algorithm!r}"
        raise ProtocolError(msg, device_id=update.device_id, topic=topic)
    if declared is None or update.num_samples > declared:
        msg = f"update claims {update.num_samples} samples, its hello declared {declared}"
        raise ProtocolError(msg, device_id=update.device_id, topic=topic)


def check_evaluation(report: EvaluationReport, metric: str, max_loss: float, topic: str) -> None:
    """A report speaks of the fleet's metric, and an error no larger than `max_loss`.

    The message model already holds accuracy to [0, 1] and an error to >= 0; how large an
    error may be depends on the task's targets, so the bound is the coordinator's.

    Raises:
        ProtocolError: another metric than the fleet's, or an error above `max_loss`.
    """
    if metric and report.metric_name != metric:
        msg = f"evaluation reports {report.metric_name}, the fleet's task measures {metric}"
        raise ProtocolError(msg, device_id=report.device_id, round_id=report.round_id, topic=topic)
    if report.metric_name == "accuracy":
        return
    worst = max(v for v in (report.personalized, report.global_model) if v is not None)
    if worst > max_loss:
        msg = f"evaluation reports {report.metric_name} {worst:g}, over the bound {max_loss:g}"
        raise ProtocolError(msg, device_id=report.device_id, round_id=report.round_id, topic=topic)


def answered_collector(
    collector: Collector[Answer] | None, message: RunAnswer, run_id: str, topic: str
) -> Collector[Answer]:
    """The collector `message` answers, if it answers this run's open round.

    Raises:
        RoundError: an earlier run's answer, a stale or future round, or no round open.
    """
    if message.run_id != run_id:
        msg = f"{message.kind} from another run ({message.run_id[:8]})"
    elif collector is None or not collector.asks(message.device_id, message.round_id):
        msg = f"stale or unexpected {message.kind}"
    else:
        return collector
    raise RoundError(msg, device_id=message.device_id, round_id=message.round_id, topic=topic)


def unpack_delta(
    update: DeviceUpdate, blob: bytes, expected: Sequence[TensorSpec], uplink: Compression
) -> Tensors:
    """An update's dense delta, decoded from the run's uplink codec and checked on the way.

    The encoded layout follows from `expected` and the codec, so a compressed frame is held to
    the same exact-layout, checksum and finiteness rules as a dense one.

    Raises:
        ProtocolError: another codec than the run's, or a blob that does not fit it.
    """
    if update.compression != uplink:
        msg = f"update encoded as {update.compression}, the run sends {uplink}"
        raise ProtocolError(msg, device_id=update.device_id, round_id=update.round_id)
    encoded = unpack_tensors(update.manifest, blob, expected=encoded_layout(expected, uplink))
    return decode(encoded, expected, uplink)
