"""A bad update from one device of a stacked round is refused for that device alone.

The stacked step trains a round's devices together, but each answers with its own encoded
update and the coordinator checks each on its own: a frame whose blob fails its checksum,
holds another layout or a NaN is dropped as if that device had not answered, and the others
aggregate to exactly what they aggregate without it. An oversized update is cut by the guard
for that device only, as on the per-device path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import DeviceUpdate
from protocols.transport.inprocess import InProcessBroker

pytestmark = pytest.mark.timeout(300)

BAD = "dev-0002"
Tamper = Callable[[DeviceUpdate, bytes], bytes | None]
"""A device update's frame rewritten (None: not sent at all)."""


class TamperingHub(InProcessBroker):
    """A hub that rewrites `BAD`'s training updates on their way to the coordinator."""

    def __init__(self, tamper: Tamper) -> None:
        super().__init__()
        self.tamper = tamper
        self.tampered = 0

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if not payload or topics.parse_topic(topic).device_id != BAD:
            super()._publish(topic, payload, retain)
            return
        message, blob = decode_frame(payload)
        if not isinstance(message, DeviceUpdate):
            super()._publish(topic, payload, retain)
            return
        self.tampered += 1
        rewritten = self.tamper(message, blob)
        if rewritten is not None:
            super()._publish(topic, rewritten, retain)


def _flipped_byte(update: DeviceUpdate, blob: bytes) -> bytes:
    """The last byte of the blob changed; the manifest's checksum kept."""
    return encode_frame(update, blob[:-1] + bytes([blob[-1] ^ 0x01]))


def _relaid(
    update: DeviceUpdate, blob: bytes, change: Callable[[torch.Tensor], torch.Tensor]
) -> bytes:
    """The first tensor replaced by `change` of it, under a manifest that matches the bytes."""
    del blob
    first = update.manifest.tensors[0]
    tensors = {spec.name: torch.zeros(spec.shape) for spec in update.manifest.tensors}
    tensors[first.name] = change(tensors[first.name])
    manifest, packed = pack_tensors(tensors)
    return encode_frame(update.model_copy(update={"manifest": manifest}), packed)


def _with_nan(update: DeviceUpdate, blob: bytes) -> bytes:
    """A NaN written over the blob's last float, under a checksum that matches the bytes."""
    poisoned = blob[:-4] + torch.tensor([float("nan")]).numpy().tobytes()
    manifest = update.manifest.model_copy(update={"sha256": hashlib.sha256(poisoned).hexdigest()})
    return encode_frame(update.model_copy(update={"manifest": manifest}), poisoned)


TAMPERS: dict[str, Tamper] = {
    "checksum": _flipped_byte,
    "shape": lambda u, b: _relaid(u, b, lambda t: t.flatten()[:-1]),
    "nan": _with_nan,
}


def _run(batched: str, tamper: Tamper | None, **values: Any) -> tuple[SimulationResult, int]:
    hub = InProcessBroker() if tamper is None else TamperingHub(tamper)
    settings = SimulationSettings.load(
        None,
        task="synthetic",
        algorithm="fedavg",
        **{"devices": 6, "rounds": 2, "seed": 5, "workers": 1, "batched": batched, **values},
    )
    result = run_simulation(settings, broker=hub)
    return result, getattr(hub, "tampered", 0)


def _max_difference(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    assert one.keys() == other.keys()
    return max(float((one[k] - other[k]).abs().max()) for k in one)


@pytest.mark.parametrize("kind", sorted(TAMPERS))
def test_a_bad_update_in_a_stacked_round_drops_that_device_alone(kind: str) -> None:
    # Execute: the device's updates tampered with, and the same run without them at all
    tampered, count = _run("on", TAMPERS[kind])
    unsent, _ = _run("on", lambda update, blob: None)
    honest, _ = _run("on", None)
    # Assert: each round dropped that one update and aggregated the other five as without it
    assert count == 2
    assert [r.participants for r in tampered.records] == [5, 5]
    assert [r.dropped for r in tampered.records] == [1, 1]
    assert [r.participants for r in unsent.records] == [5, 5]
    assert _max_difference(tampered.final_shared, unsent.final_shared) == 0.0
    assert _max_difference(tampered.final_shared, honest.final_shared) > 0.0


def test_an_oversized_update_in_a_stacked_round_is_cut_for_that_device_alone() -> None:
    # Execute: one device of the six scales its update by 100, stacked and per device
    attack = {"attack": "scaling", "malicious_fraction": 0.17}
    stacked, _ = _run("on", None, **attack)
    per_device, _ = _run("off", None, **attack)
    # Assert: the guard cut the same updates (the first round: the liar's alone), and both
    # paths aggregate the same
    cuts = [r.scalars.get("guard_cut") for r in stacked.records]
    assert cuts[0] == 1.0
    assert cuts == [r.scalars.get("guard_cut") for r in per_device.records]
    assert _max_difference(stacked.final_shared, per_device.final_shared) <= 1e-5
