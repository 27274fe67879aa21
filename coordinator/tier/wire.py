"""The aggregator tier's own messages: the round's plan down, one partial aggregate up.

    pfl/<fleet>/tier/plan                   retained TierPlan                  coordinator -> aggs
    pfl/<fleet>/tier/close                  TierClose: send what you have      coordinator -> aggs
    pfl/<fleet>/tier/<aggregator>/partial   PartialAggregate + float64 sums    aggregator -> coord
    pfl/<fleet>/tier/<aggregator>/status    retained AggregatorStatus          aggregator -> status

A frame is `PFLT`, a 4-byte header length, the JSON header and (for a partial) a safetensors
blob checked against the header's manifest (`protocols.codec.unpack_tensors`: layout, SHA-256,
finite values). No pickle; nothing a sender writes is trusted before it is checked.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Final, Literal

import torch
from pydantic import Field

from protocols import topics
from protocols.codec import Tensors, pack_tensors, unpack_tensors
from protocols.errors import ProtocolError
from protocols.messages import DevicePrivacy, TensorManifest, TensorSpec, WireModel

MAGIC: Final = b"PFLT"
_PREFIX: Final = len(MAGIC) + 4
MAX_HEADER_BYTES: Final = 16 * 1024 * 1024
"""A header lists device ids: 100,000 ids of 64 characters fit."""
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


def plan_topic(fleet: str) -> str:
    """Retained: the round the aggregators collect now."""
    return f"pfl/{fleet}/tier/plan"


def close_topic(fleet: str) -> str:
    """The coordinator's deadline passed: each aggregator sends what it has."""
    return f"pfl/{fleet}/tier/close"


def partial_topic(fleet: str, aggregator: str) -> str:
    """One aggregator's partial aggregates."""
    return f"pfl/{fleet}/tier/{aggregator}/partial"


def status_topic(fleet: str, aggregator: str) -> str:
    """Retained: one aggregator's status (`protocols.topics.aggregator_status`, for ACLs)."""
    return topics.aggregator_status(fleet, aggregator)


def partial_subscription(fleet: str) -> str:
    """Every aggregator's partial aggregates (the coordinator reads them)."""
    return f"pfl/{fleet}/tier/+/partial"


class TierPlan(WireModel):
    """What an aggregator needs beyond the announcement to check and sum its group's updates."""

    kind: Literal["tier-plan"] = "tier-plan"
    run_id: Name
    round_id: int = Field(ge=0)
    algorithm: Name
    specs: tuple[TensorSpec, ...]
    """The shared tensors' layout: what every update must have."""
    declared: dict[Name, int] = Field(default_factory=dict)
    """Each asked device's sample count as its hello declared it to the coordinator: the most
    its update may claim (an aggregator started after the hellos has not seen them)."""
    equal_weights: bool
    """Each update weighs 1 (uniform aggregation, or DP); else its sample count."""
    clip_norm: float = Field(gt=0, le=1e6)
    """Each update is clipped to this L2 norm before it is summed."""
    privacy: DevicePrivacy | None = None
    train_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    """A secure round: how long the group's masked updates are waited for (the coordinator's
    round timeout; its other phases take the announcement's phase timeout)."""


class TierClose(WireModel):
    """The coordinator stops waiting for round `round_id`: send the partial now."""

    kind: Literal["tier-close"] = "tier-close"
    run_id: Name
    round_id: int = Field(ge=0)


class PartialAggregate(WireModel):
    """One group's contribution to a round: sum_i w_i clip(delta_i), sum_i w_i, and scalars."""

    kind: Literal["partial-aggregate"] = "partial-aggregate"
    run_id: Name
    round_id: int = Field(ge=1)
    aggregator: Name
    devices: tuple[Name, ...]
    """The devices whose updates are in the sum (sorted, each once)."""
    weight: float = Field(ge=0, le=1e15)
    """sum_i w_i."""
    loss_sum: float = Field(ge=0, le=1e15)
    """sum_i n_i loss_i (the round's train loss is its sum over groups / total samples)."""
    samples: int = Field(ge=0)
    """sum_i n_i."""
    within_clip: float | None = None
    """Under DP's adaptive clipping: the sum of the devices' noised bits."""
    manifest: TensorManifest = TensorManifest()


class AggregatorStatus(WireModel):
    """What `pfl-coord status` shows of an aggregator: its group and its last round."""

    kind: Literal["aggregator-status"] = "aggregator-status"
    aggregator: Name
    group: str = Field(default="", max_length=200)
    """Which devices it serves, in words ("3 listed devices", "hash group 0 of 2")."""
    state: Literal["online", "offline"] = "online"
    run_id: Name | None = None
    round_id: int | None = Field(default=None, ge=0)
    """The last round it collected (None: none yet)."""
    asked: int = Field(default=0, ge=0)
    """Devices of its group that round asked."""
    devices: int = Field(default=0, ge=0)
    """Devices in that round's partial (0 until it is sent)."""
    partial_sent: bool = False
    partials_sent: int = Field(default=0, ge=0)
    """Partials sent since it started."""
    sent_at: float = Field(default_factory=time.time, ge=0)


TierMessage = TierPlan | TierClose | PartialAggregate | AggregatorStatus
_KINDS: Final[dict[str, type[TierMessage]]] = {
    "tier-plan": TierPlan,
    "tier-close": TierClose,
    "partial-aggregate": PartialAggregate,
    "aggregator-status": AggregatorStatus,
}


def encode(header: TierMessage, sums: Tensors | None = None) -> bytes:
    """A frame of `header` (a partial: with its float64 sums as the blob)."""
    blob = b""
    if isinstance(header, PartialAggregate):
        manifest, blob = pack_tensors(sums or {})
        header = header.model_copy(update={"manifest": manifest})
    text = header.model_dump_json().encode()
    return b"".join((MAGIC, len(text).to_bytes(4, "big"), text, blob))


def decode(payload: bytes, max_bytes: int) -> tuple[TierMessage, bytes]:
    """The header and the unchecked blob of a tier frame.

    Raises:
        ProtocolError: too large, another magic, a header beyond the frame, or an invalid header.
    """
    if len(payload) > max_bytes:
        msg = f"tier frame of {len(payload)} bytes exceeds the limit of {max_bytes}"
        raise ProtocolError(msg)
    if len(payload) < _PREFIX or payload[: len(MAGIC)] != MAGIC:
        msg = "not a tier frame"
        raise ProtocolError(msg)
    end = _PREFIX + int.from_bytes(payload[len(MAGIC) : _PREFIX], "big")
    if end > len(payload) or end - _PREFIX > MAX_HEADER_BYTES:
        msg = "tier frame header runs beyond its frame"
        raise ProtocolError(msg)
    text = payload[_PREFIX:end]
    try:
        kind = json.loads(text).get("kind")
        return _KINDS[kind].model_validate_json(text), payload[end:]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        msg = f"tier frame with an unknown or invalid header: {str(error)[:200]}"
        raise ProtocolError(msg) from None


def partial_sums(partial: PartialAggregate, blob: bytes, specs: tuple[TensorSpec, ...]) -> Tensors:
    """The partial's sums, held to the run's layout (in float64) and finite.

    Raises:
        ProtocolError: another layout, a blob that does not match its manifest, or NaN/Inf.
    """
    expected = tuple(spec.model_copy(update={"dtype": "float64"}) for spec in specs)
    return unpack_tensors(partial.manifest, blob, expected=expected)


def as_float64(tensors: Tensors) -> dict[str, torch.Tensor]:
    """`tensors` in float64 (how sums travel: no rounding between the tiers)."""
    return {name: tensor.to(torch.float64) for name, tensor in tensors.items()}
