"""DP's bound holds on what a device actually sends, and placements that cannot hold it are refused.

With error feedback a lossy codec sends the clipped delta plus what earlier rounds left out, so
the sent delta grew past the clip norm round after round; device-placed noise without secure
aggregation leaves each update with 1/sqrt(m) of the noise, and nothing clips it afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols import topics
from protocols.codec import decode_frame, describe_tensors, unpack_tensors
from protocols.compression import decode
from protocols.messages import DeviceUpdate
from protocols.privacy import update_norm
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import TASK, hub_agents, hub_coordinator

CLIP = 0.05
ROUNDS = 6


@pytest.mark.parametrize("codec", ["topk:0.1", "int8:stochastic"])
def test_what_a_device_sends_under_dp_stays_within_the_clip_round_after_round(
    codec: str,
) -> None:
    # Prepare: large steps and a small clip, so every delta is clipped and the codec's
    # residual grows; a spy decodes every update as the coordinator does
    broker = InProcessBroker()
    run = {"dp_noise": 1.0, "dp_clip": CLIP, "compress": codec, "lr": 0.5}
    coordinator = hub_coordinator(broker, "fedavg", 3, ROUNDS, run=run)
    layout = describe_tensors(coordinator.shared)
    norms: list[float] = []

    def spy(topic: str, payload: bytes) -> None:
        header, blob = decode_frame(payload)
        assert isinstance(header, DeviceUpdate)
        encoded = unpack_tensors(header.manifest, blob)
        norms.append(update_norm(decode(encoded, layout, header.compression)))

    broker.connect("spy").subscribe(topics.device_subscription("default", "update"), spy)
    hub_agents(broker, ("dev-a", "dev-b", "dev-c"))
    coordinator.start()
    coordinator.wait_for_devices(3, 1.0)

    # Execute
    for _ in range(ROUNDS):
        coordinator.run_round()

    # Assert: every update of every round, as decoded, within the clip norm
    assert len(norms) == 3 * ROUNDS
    assert max(norms) <= CLIP
    assert min(norms) > 0.5 * CLIP  # clipped, not lost: the bound is not met by sending nothing


def test_device_placed_noise_without_secure_aggregation_is_refused_before_any_round() -> None:
    settings = SimulationSettings.load(
        None, task=TASK, devices=4, rounds=1, dp_noise=1.0, dp_placement="device"
    )
    with pytest.raises(ValueError, match="--dp-placement device needs --secagg") as refused:
        run_simulation(settings)
    assert "1/sqrt" in str(refused.value)


@pytest.mark.parametrize(
    "options",
    [
        {"dp_noise": 1.0, "dp_placement": "device", "secagg": True},
        {"dp_noise": 1.0, "compress": "topk:0.1"},
    ],
    ids=["device-noise-under-secagg", "dp-with-topk"],
)
def test_what_dp_can_guarantee_still_runs(options: dict[str, Any]) -> None:
    settings = SimulationSettings.load(None, task=TASK, devices=4, rounds=1, workers=1, **options)
    result = run_simulation(settings)
    assert [r.participants for r in result.records] == [4]
