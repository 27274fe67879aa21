"""The one way out of a device: every message it emits is vetted here against the run's privacy.

Every field of every message a device may send is classified once, in `EXITS`:

    NOT_DATA   says nothing about the device's data (ids, rounds, keys, settings): sent as is
    PROTECTED  data that leaves only through the mechanism: the clipped and noised delta, the
               noised within-clip bit, secure aggregation's masked vector
    WITHHELD   data-derived (training loss, sample count, algorithm scalars): never sent exactly
               under DP or secure aggregation; a neutral value goes in its place
    DISCLOSED  data-derived and sent in the clear even under DP (the hello's sample count,
               held-out metrics, export metrics): outside the guarantee, withheld in strict mode

A nested model in a NOT_DATA field has its own fields classified too; a message kind missing
from `EXITS` is the coordinator's and never leaves a device. A field added to the protocol
without a class here makes `vet` refuse the message (and tests/device_agent/test_egress.py fail).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Final

import torch

from protocols import topics
from protocols.codec import Tensors, encode_frame
from protocols.errors import PflError
from protocols.messages import (
    Capabilities,
    Compression,
    DeviceHello,
    DeviceStatus,
    DeviceUpdate,
    Eligibility,
    EvaluationReport,
    ExportReport,
    Message,
    PeerRequest,
    RevealedShare,
    RoundAnnouncement,
    SealedShares,
    SecAggKeys,
    SecAggReveal,
    SecAggShares,
    WireModel,
)
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)


class Release(Enum):
    """How a field may leave the device (see the module docstring)."""

    NOT_DATA = "not data"
    PROTECTED = "protected"
    WITHHELD = "withheld"
    DISCLOSED = "disclosed"


class EgressError(PflError):
    """A message the gate cannot classify: the coordinator's kind, or a field not classified."""


DROP: Final = object()
"""The neutral value of a field no stand-in can replace: the whole message stays on the device."""

N, P, W, D = Release.NOT_DATA, Release.PROTECTED, Release.WITHHELD, Release.DISCLOSED
BASE: Final = {"protocol_version": N, "sent_at": N}
"""Every message's version and send time (the time says when, as the broker sees anyway)."""


@dataclass(frozen=True)
class Exit:
    """A message kind a device sends: its topic, whether retained, each field's class."""

    topic: topics.DeviceTopicKind
    fields: dict[str, Release]
    neutral: dict[str, object]
    """What a WITHHELD or DISCLOSED field carries instead when withheld (absent: DROP)."""
    retain: bool = False


EXITS: Final[dict[type[Message], Exit]] = {
    DeviceHello: Exit(
        "hello",
        {
            **BASE,
            "kind": N,
            "device_id": N,
            "task": N,
            "num_train_samples": D,
            "capabilities": N,
            "memory_plan": D,  # its planned peak counts the process's memory, the data included
            "stateful": N,
            "instance": N,
            "eligibility": N,
        },
        {"num_train_samples": 1, "memory_plan": None},  # 1: the weight of every DP update
    ),
    DeviceStatus: Exit(
        "status",
        {
            **BASE,
            "kind": N,
            "device_id": N,
            "state": N,
            "round_id": N,
            "run_id": N,
            "last_loss": W,
            "detail": D,  # free text: a decline's or an error's reason may quote a metric
        },
        {"last_loss": None, "detail": ""},
        retain=True,
    ),
    DeviceUpdate: Exit(
        "update",
        {
            **BASE,
            "kind": N,
            "run_id": N,
            "round_id": N,
            "device_id": N,
            "algorithm": N,
            "num_samples": W,
            "train_loss": W,
            "scalars": W,
            "compression": N,
            "within_clip": P,
            "manifest": P,
        },
        {"num_samples": 1, "train_loss": 0.0, "scalars": {}},
    ),
    EvaluationReport: Exit(
        "evaluation",
        {
            **BASE,
            "kind": N,
            "run_id": N,
            "round_id": N,
            "device_id": N,
            "metric_name": N,
            "personalized": D,
            "global_model": D,
            "num_test_samples": D,
            "num_train_samples": D,
        },
        {},  # a report without its metrics says nothing: in strict mode none is sent
    ),
    PeerRequest: Exit(
        "request",
        {
            **BASE,
            "kind": N,
            "run_id": N,
            "round_id": N,
            "phase": N,
            "device_id": N,
            "models": W,  # FedeRiCo samples peers by its losses
            "cached": N,
        },
        {},
    ),
    ExportReport: Exit(
        "export-report",
        {
            **BASE,
            "kind": N,
            "round_id": N,
            "device_id": N,
            "ok": N,
            "path": N,
            "size_bytes": N,
            "sha256": D,  # a digest of the personalized model
            "parity_max_abs_diff": D,
            "metrics": D,
            "error": D,
        },
        {"sha256": "", "parity_max_abs_diff": None, "metrics": {}, "error": ""},
    ),
    SecAggKeys: Exit(
        "secagg",
        {
            **BASE,
            "kind": N,
            "run_id": N,
            "round_id": N,
            "device_id": N,
            "channel_key": N,
            "mask_key": N,
            "seed_commitment": N,
        },
        {},
    ),
    SecAggShares: Exit(
        "secagg",
        {**BASE, "kind": N, "run_id": N, "round_id": N, "device_id": N, "shares": N},
        {},
    ),
    SecAggReveal: Exit(
        "secagg",
        {**BASE, "kind": N, "run_id": N, "round_id": N, "device_id": N, "shares": N},
        {},
    ),
}
COORDINATOR_KINDS: Final = frozenset(
    {
        "coordinator-status",
        "fleet-status",
        "fleet-summary",
        "fleet-row",
        "run-history",
        "shared-model",
        "model-delta",
        "round",
        "peer-models",
        "command",
        "secagg-roster",
        "secagg-inbox",
        "secagg-unmask",
    }
)
"""The kinds only the coordinator sends: `vet` refuses them on a device."""
PARTS: Final[dict[type[WireModel], dict[str, Release]]] = {
    Capabilities: dict.fromkeys(
        ("cores", "memory_bytes", "arch", "torch_version", "python_version"), N
    ),
    Eligibility: dict.fromkeys(
        ("min_free_memory_bytes", "max_load_per_core", "require_mains_power"), N
    ),
    Compression: dict.fromkeys(("codec", "fraction", "rounding"), N),
    SealedShares: dict.fromkeys(
        ("holder", "sealed", "seed_share_commitment", "key_share_commitment"), N
    ),
    RevealedShare: dict.fromkeys(("dealer", "secret", "share", "salt"), N),
}
"""The fields of models nested in NOT_DATA fields: random keys, shares, this device's settings."""


@dataclass(frozen=True)
class Regime:
    """What the message at hand may release: `private` under DP or secure aggregation."""

    private: bool = False
    strict: bool = False

    def withholds(self, release: Release) -> bool:
        """Whether a field of class `release` stays on the device."""
        if release is Release.WITHHELD:
            return self.private or self.strict
        return release is Release.DISCLOSED and self.strict


def protected(announcement: RoundAnnouncement) -> bool:
    """Whether work on `announcement` runs under DP or secure aggregation."""
    return announcement.privacy is not None or announcement.secure is not None


def vet(message: Message, regime: Regime) -> Message | None:
    """`message` as `regime` lets it leave (withheld fields neutral), or None: it stays here.

    Raises:
        EgressError: a kind devices do not send, or a field `EXITS` does not classify.
    """
    kind = type(message).model_fields["kind"].default
    exit_ = EXITS.get(type(message))
    if exit_ is None:
        msg = f"a device does not send {kind} messages"
        raise EgressError(msg)
    unknown = set(type(message).model_fields) - set(exit_.fields)
    if unknown:
        msg = f"{kind}: fields {sorted(unknown)} are not classified for egress"
        raise EgressError(msg)
    changes: dict[str, object] = {}
    for name, release in exit_.fields.items():
        if regime.withholds(release):
            neutral = exit_.neutral.get(name, DROP)
            if neutral is DROP:
                return None
            changes[name] = neutral
    return message.model_copy(update=changes) if changes else message


def without_counters(delta: Tensors) -> Tensors:
    """The delta with every integer tensor's entry zero: under DP counters stay on the device.

    Clipping and noise act on floating tensors only, so an integer tensor (BatchNorm's
    `num_batches_tracked`) would travel exact and tell the local step count, hence the sample
    count. Its delta is sent as zero (the layout stays the run's): the shared value is the
    coordinator's own.
    """
    return {
        name: value if value.is_floating_point() else torch.zeros_like(value)
        for name, value in delta.items()
    }


def will_frame(status: DeviceStatus, *, strict: bool = False) -> bytes:
    """The frame of a last-will status, vetted like any other (it leaves when the device is gone).

    Raises:
        EgressError: the status would be withheld whole (a status has a stand-in for each field).
    """
    vetted = vet(status, Regime(private=True, strict=strict))
    if vetted is None:
        msg = "a last-will status cannot be withheld"
        raise EgressError(msg)
    return encode_frame(vetted)


class Egress:
    """The device's only publisher: vets each message, encodes it, sends it on its topic.

    Args:
        strict: release nothing outside DP's guarantee (`--dp-strict-egress`): no DISCLOSED
            field leaves, and this device declines work that would need one (`refusal`).
    """

    def __init__(
        self, transport: Transport, fleet: str, device_id: str, *, strict: bool = False
    ) -> None:
        self.transport = transport
        self.fleet = fleet
        self.device_id = device_id
        self.strict = strict
        self._loss_private = False
        """The loss this device holds came from a round under DP or secure aggregation."""

    def send(
        self, message: Message, blob: bytes = b"", *, answering: RoundAnnouncement | None = None
    ) -> bytes | None:
        """Vet, encode and publish `message`; its frame, or None when it stays on the device.

        `answering`: the round the message answers (its DP and secure aggregation). A status,
        which answers none, is vetted as private while the loss the device holds is.

        Raises:
            EgressError: a message the gate cannot classify (nothing is sent).
        """
        if isinstance(message, DeviceUpdate) and answering is not None:
            self._loss_private = protected(answering)
        private = protected(answering) if answering is not None else self._loss_private
        vetted = vet(message, Regime(private=private, strict=self.strict))
        if vetted is None:
            logger.info("device %s: a %s withheld (egress)", self.device_id, type(message).__name__)
            return None
        frame = encode_frame(vetted, blob)
        exit_ = EXITS[type(message)]
        topic = topics.device(self.fleet, self.device_id, exit_.topic)
        self.transport.publish(topic, frame, retain=exit_.retain)
        return frame

    def refusal(self, announcement: RoundAnnouncement) -> str | None:
        """Why strict egress declines `announcement`'s work (None: it may answer)."""
        if not self.strict:
            return None
        if announcement.phase == "train" and announcement.privacy is None:
            return "strict egress: this device trains only under differential privacy"
        if announcement.phase == "evaluate":
            return "strict egress: held-out metrics are not released"
        return None
