"""Compressed updates: honest devices train through them, forged ones are dropped and counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from coordinator.engine.rounds import Coordinator
from coordinator.run.pipeline import privacy_of
from coordinator.run.settings import SimulationSettings
from device_agent.context import RESIDUAL_PREFIX
from device_agent.state_store import MemoryStateStore
from protocols import topics
from protocols.codec import Tensors, encode_frame, pack_tensors
from protocols.compression import INT8, INT8_SCALES, TOPK_INDICES, encode
from protocols.messages import Compression, DeviceUpdate, RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import TASK, hub_agents, hub_coordinator, hub_impostor

HONEST = ["dev-0", "dev-1", "dev-2"]
TOP1 = Compression(codec="topk", fraction=0.01)


def _forger(
    broker: InProcessBroker,
    coordinator: Coordinator,
    forge: Callable[[RoundAnnouncement], tuple[Compression, Tensors]],
) -> list[int]:
    """A client with a device's identity answering each training round with a forged update."""
    sent: list[int] = []

    def on_round(transport: Transport, message: RoundAnnouncement) -> None:
        if message.phase != "train":
            return
        compression, tensors = forge(message)
        manifest, blob = pack_tensors(tensors)
        header = DeviceUpdate(
            run_id=message.run_id,
            round_id=message.round_id,
            device_id="forger",
            algorithm=message.algorithm,
            num_samples=10,
            train_loss=0.0,
            compression=compression,
            manifest=manifest,
        )
        transport.publish(topics.device("default", "forger", "update"), encode_frame(header, blob))
        sent.append(message.round_id)

    hub_impostor(broker, "forger", on_round)
    return sent


def _honest_delta(coordinator: Coordinator) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(value, 0.5) for name, value in coordinator.shared.items()}


FORGERIES: dict[
    str, Callable[[Coordinator], Callable[[RoundAnnouncement], tuple[Compression, Tensors]]]
] = {
    "a codec other than the run's": lambda c: lambda _: (Compression(), _honest_delta(c)),
    "a larger k than the run's fraction": lambda c: (
        lambda _: (
            TOP1,
            encode(_honest_delta(c), Compression(codec="topk", fraction=0.5)),
        )
    ),
    "a repeated index": lambda c: (
        lambda _: (
            TOP1,
            _repeated_index(encode(_honest_delta(c), TOP1)),
        )
    ),
    "an index past the end": lambda c: (
        lambda _: (
            TOP1,
            _index_past_the_end(encode(_honest_delta(c), TOP1)),
        )
    ),
}


def _repeated_index(encoded: Tensors) -> Tensors:
    indices = encoded[TOPK_INDICES].clone()
    indices[1] = indices[0]
    return {**encoded, TOPK_INDICES: indices}


def _index_past_the_end(encoded: Tensors) -> Tensors:
    indices = encoded[TOPK_INDICES].clone()
    indices[-1] = 10**9
    return {**encoded, TOPK_INDICES: indices}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_compressed_update_is_dropped_and_counted(forgery: str) -> None:
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", len(HONEST), 2, run={"compress": "topk:0.01"})
    coordinator.start()
    hub_agents(broker, HONEST)
    sent = _forger(broker, coordinator, FORGERIES[forgery](coordinator))
    assert coordinator.wait_for_devices(len(HONEST) + 1, 2.0)
    record = coordinator.run_round()
    assert sent == [1]
    assert coordinator.offences.counts() == {"forger": 1}
    assert record.participants == len(HONEST)
    assert all(torch.isfinite(v).all() for v in coordinator.shared.values())


@pytest.mark.parametrize("codec", ["int8", "int8:stochastic", "topk:0.1"])
def test_devices_train_through_a_codec_and_keep_the_residual_only_when_stateful(
    codec: str,
) -> None:
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", 2, 2, run={"compress": codec})
    coordinator.start()
    stores = [MemoryStateStore(), MemoryStateStore()]
    hub_agents(
        broker, ["stateful", "stateless"], lambda i: {"store": stores[i], "stateful": i == 0}
    )
    assert coordinator.wait_for_devices(2, 2.0)
    before = {k: v.clone() for k, v in coordinator.shared.items()}
    records = [coordinator.run_round() for _ in range(2)]
    assert [r.participants for r in records] == [2, 2]
    assert any(not torch.equal(before[k], coordinator.shared[k]) for k in before)
    kept = stores[0]._tensors or {}
    residual = {k: v for k, v in kept.items() if k.startswith(RESIDUAL_PREFIX)}
    assert set(residual) == {RESIDUAL_PREFIX + n for n in coordinator.shared_names}
    assert any(bool(v.abs().sum() > 0) for v in residual.values())  # something was left out
    assert stores[1]._tensors is None  # a stateless device keeps nothing


def _overflowing_int8(coordinator: Coordinator) -> Tensors:
    """An honest-looking int8 update whose scales (finite) make every level decode to +-Inf."""
    encoded = encode(_honest_delta(coordinator), INT8)
    return {**encoded, INT8_SCALES: torch.full_like(encoded[INT8_SCALES], 3e38)}


def test_under_dp_an_int8_update_decoding_to_inf_is_dropped_and_no_round_is_skipped() -> None:
    # Prepare: DP at the coordinator, every device in every round, one forger of four
    rounds = 3
    run = {"compress": "int8", "dp_noise": 1.0, "dp_sampling": "fixed"}
    settings = SimulationSettings.load(
        None, task=TASK, algorithm="fedavg", devices=len(HONEST) + 1, rounds=rounds, **run
    )
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", len(HONEST) + 1, rounds, run=run)
    privacy = privacy_of(coordinator)  # hub_coordinator's, seeded with the run's seed 0
    coordinator.settings = replace(coordinator.settings, guard=settings.guard_settings())
    coordinator.start()
    hub_agents(broker, HONEST)
    sent = _forger(broker, coordinator, lambda _: (INT8, _overflowing_int8(coordinator)))
    assert coordinator.wait_for_devices(len(HONEST) + 1, 2.0)

    # Execute
    records = [coordinator.run_round() for _ in range(rounds)]

    # Assert: the forger's update never reaches DP or the strategy; every round is released
    assert sent == [1, 2, 3]
    assert coordinator.offences.counts() == {"forger": rounds}
    assert [r.participants for r in records] == [len(HONEST)] * rounds
    assert all("aggregate_rejected" not in r.scalars for r in records)
    epsilons = [r.scalars["dp_epsilon"] for r in records]
    assert epsilons == sorted(set(epsilons))  # one step per released round
    assert privacy is not None
    assert privacy.report()["rounds_released"] == rounds
    assert all(torch.isfinite(v).all() for v in coordinator.shared.values())
