"""What one device can put on its own status topic for operator views, and a strict JSON reader.

Shared by the view tests (tests/coordinator/test_operator_views.py) and the adversary run on
the provisioned mosquitto (tests/e2e/test_adversary.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from protocols import topics
from protocols.codec import MAGIC, encode_frame
from protocols.messages import (
    CoordinatorStatus,
    DeviceResult,
    DeviceStatus,
    FleetDevice,
    FleetRow,
    FleetStatus,
    FleetSummary,
    Message,
    RoundSummary,
    RunHistory,
)

FUTURE_S = 3000.0
"""How far ahead the forged future timestamp lies (beyond any clock skew a view allows)."""


def forged_views(
    fleet: str, attacker: str, victims: Sequence[str], run_id: str
) -> list[tuple[str, bytes]]:
    """(topic, frame) pairs on `attacker`'s own status topic, none of them its own status.

    A coordinator status (round 20 of 999), a fleet status (every victim offline and
    quarantined, a ghost), a history (accuracy 0.999), a victim's and a ghost's status, then
    the attacker's own status with `sent_at` Infinity, NaN and far in the future (last).
    """
    own = topics.device(fleet, attacker, "status")
    shown_down = tuple(
        FleetDevice(device_id=v, online=False, last_seen=1.0, quarantined=True) for v in victims
    )
    result = DeviceResult(
        device_id=victims[0],
        round_id=20,
        metric_name="accuracy",
        personalized=0.999,
        num_train_samples=1,
    )
    forged: list[Message] = [
        CoordinatorStatus(state="running", fleet=fleet, round_id=20, rounds=999),
        FleetStatus(
            fleet=fleet,
            round_id=20,
            devices=(*shown_down, FleetDevice(device_id="ghost-1", online=True, last_seen=1.0)),
        ),
        FleetSummary(fleet=fleet, epoch="0", round_id=20, registered=999),
        FleetRow(
            fleet=fleet,
            epoch="0",
            device=FleetDevice(device_id="ghost-3", online=True, last_seen=1.0),
        ),
        FleetRow(fleet=fleet, epoch="0", device=shown_down[0]),
        RunHistory(
            fleet=fleet,
            run_id=run_id,
            rounds=(RoundSummary(round_id=20, selected=1, participants=1),),
            devices=(result,),
        ),
        DeviceStatus(device_id=victims[-1], state="offline"),
        DeviceStatus(device_id="ghost-2", state="online"),
    ]
    frames = [(own, encode_frame(message)) for message in forged]
    status = DeviceStatus(device_id=attacker, state="online").model_dump(mode="json")
    for sent_at in (float("inf"), float("nan"), time.time() + FUTURE_S):
        frames.append((own, raw_frame({**status, "sent_at": sent_at})))
    return frames


def raw_frame(header: dict[str, Any]) -> bytes:
    """A frame whose header JSON is written by hand, e.g. with `Infinity` in it."""
    text = json.dumps(header).encode()  # json writes inf as Infinity, which parsers may take
    return MAGIC + len(text).to_bytes(4, "big") + text


def strict_json(text: str) -> Any:
    """`text` parsed as JSON proper: NaN and Infinity are errors."""

    def refuse(constant: str) -> None:
        msg = f"not JSON: {constant}"
        raise ValueError(msg)

    return json.loads(text, parse_constant=refuse)
