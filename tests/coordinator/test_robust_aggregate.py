"""Robust aggregation: clipping, median and trimmed mean against hand computations and attackers."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.strategies import build_strategy
from coordinator.strategies.aggregate import (
    centered_clipping,
    coordinate_median,
    robust_combine,
    trimmed_mean,
    weighted_mean,
)
from coordinator.strategies.base import ReceivedUpdate
from protocols import topics
from protocols.algorithms import FedAltConfig, FedAvgConfig
from protocols.codec import Tensors, decode_frame, encode_frame, pack_tensors
from protocols.messages import Capabilities, DeviceHello, DeviceUpdate, RoundAnnouncement
from protocols.privacy import clip_to_norm
from protocols.transport.inprocess import InProcessBroker

RUN = "0" * 32


def _deltas(*values: list[float]) -> list[Tensors]:
    return [{"w": torch.tensor(v, dtype=torch.float32)} for v in values]


def test_clip_scales_only_updates_above_the_bound_over_all_tensors() -> None:
    delta = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "n": torch.tensor(7)}
    clipped = clip_to_norm(delta, 1.0)  # ||(3, 0, 4)|| = 5, so scale by 1/5
    torch.testing.assert_close(clipped["a"], torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(clipped["b"], torch.tensor([0.8]))
    assert int(clipped["n"]) == 7
    unchanged = clip_to_norm(delta, 10.0)
    torch.testing.assert_close(unchanged["a"], delta["a"])
    torch.testing.assert_close(clip_to_norm({"z": torch.zeros(2)}, 1.0)["z"], torch.zeros(2))
    with pytest.raises(ValueError, match="positive"):
        clip_to_norm(delta, 0.0)


def test_median_is_coordinate_wise_and_averages_the_middle_pair() -> None:
    odd = coordinate_median(_deltas([1.0, -5.0], [5.0, 0.0], [100.0, 2.0]))
    torch.testing.assert_close(odd["w"], torch.tensor([5.0, 0.0]))
    even = coordinate_median(_deltas([1.0], [2.0], [3.0], [100.0]))
    torch.testing.assert_close(even["w"], torch.tensor([2.5]))
    with pytest.raises(ValueError, match="counters, never averaged: n"):
        coordinate_median([{"n": torch.tensor(1)}, {"n": torch.tensor(2)}])


def test_trimmed_mean_drops_k_values_at_each_end() -> None:
    deltas = _deltas([1.0], [2.0], [3.0], [4.0], [100.0])
    torch.testing.assert_close(trimmed_mean(deltas, 0.2)["w"], torch.tensor([3.0]))  # k = 1
    torch.testing.assert_close(trimmed_mean(deltas, 0.1)["w"], torch.tensor([22.0]))  # k = 0
    torch.testing.assert_close(trimmed_mean(deltas, 0.5)["w"], torch.tensor([3.0]))  # median
    with pytest.raises(ValueError, match="trim_fraction"):
        trimmed_mean(deltas, 0.6)
    with pytest.raises(ValueError, match="at least one"):
        trimmed_mean([], 0.1)


def test_robust_combine_dispatches_and_mean_keeps_the_weights() -> None:
    deltas = _deltas([0.0], [10.0])
    torch.testing.assert_close(
        robust_combine(deltas, [1.0, 3.0])["w"], weighted_mean(deltas, [1.0, 3.0])["w"]
    )
    torch.testing.assert_close(
        robust_combine(deltas, [1.0, 3.0], method="median")["w"], torch.tensor([5.0])
    )
    with pytest.raises(ValueError, match="unknown aggregation"):
        robust_combine(deltas, [1.0, 1.0], method="mode")


def _poisoned(rng: np.random.Generator) -> list[ReceivedUpdate]:
    """Four honest devices with small deltas and an attacker claiming a huge update and count."""
    honest = [
        ReceivedUpdate(
            f"dev-{i}", 10, 1.0, {"w": torch.tensor(rng.uniform(-0.1, 0.1, 6), dtype=torch.float32)}
        )
        for i in range(4)
    ]
    attack = ReceivedUpdate("evil", 1000, 1.0, {"w": torch.full((6,), 1e6)})
    return [*honest, attack]


def _move(config: FedAvgConfig, updates: list[ReceivedUpdate]) -> torch.Tensor:
    shared = {"w": torch.zeros(6)}
    return build_strategy(config, 1.0).aggregate(1, shared, updates).shared["w"]


def test_clipping_bounds_the_attackers_pull_by_its_weight_share() -> None:
    rng = np.random.default_rng(0)
    updates = _poisoned(rng)
    bound = 0.5
    move = _move(FedAvgConfig(clip_update_norm=bound), updates)
    share = 1000 / (4 * 10 + 1000)
    honest_part = sum(10 * clip_to_norm(u.shared_delta, bound)["w"] for u in updates[:4]) / 1040
    attacker_pull = float(torch.linalg.vector_norm(move - honest_part))
    assert attacker_pull == pytest.approx(bound * share, rel=1e-5)
    assert float(torch.linalg.vector_norm(move)) <= bound + 1e-6
    unclipped = _move(FedAvgConfig(), updates)
    assert float(unclipped.abs().max()) > 1e5  # without the defence the model is ruined


@pytest.mark.parametrize("method", ["median", "trimmed-mean"])
def test_median_and_trimmed_mean_stay_within_the_honest_updates(method: str) -> None:
    updates = _poisoned(np.random.default_rng(1))
    config = FedAvgConfig(robust_aggregation=method, trim_fraction=0.2)  # type: ignore[arg-type]
    move = _move(config, updates)
    honest = torch.stack([u.shared_delta["w"] for u in updates[:4]])
    assert bool((move >= honest.min(dim=0).values - 1e-7).all())
    assert bool((move <= honest.max(dim=0).values + 1e-7).all())


def test_strategies_subclassing_fedavg_inherit_the_defence() -> None:
    updates = _poisoned(np.random.default_rng(2))
    shared = {"w": torch.zeros(6)}
    strategy = build_strategy(FedAltConfig(robust_aggregation="median"), 1.0)
    moved = strategy.aggregate(1, shared, updates).shared["w"]
    assert float(moved.abs().max()) <= 0.1


# -- through the round engine: a NaN update is rejected and counted, the round still closes --


class ScriptedFleet:
    """Devices on the in-process hub that answer each train round with a delta chosen per device."""

    def __init__(
        self, broker: InProcessBroker, deltas: dict[str, Callable[[int, str], bytes]]
    ) -> None:
        self.transport = broker.connect("scripted-fleet")
        self.deltas = deltas
        self.transport.subscribe(topics.round_announcement("default"), self._on_round)

    def hello(self) -> None:
        capabilities = Capabilities(
            cores=1, memory_bytes=1, arch="x", torch_version="x", python_version="x"
        )
        for device_id in self.deltas:
            hello = DeviceHello(
                device_id=device_id, task="", num_train_samples=10, capabilities=capabilities
            )
            self.transport.publish(
                topics.device("default", device_id, "hello"), encode_frame(hello)
            )

    def _on_round(self, _topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        if announcement.phase != "train":
            return
        for device_id, frame in self.deltas.items():
            topic = topics.device("default", device_id, "update")
            self.transport.publish(topic, frame(announcement.round_id, device_id))


def update_frame(
    round_id: int, device_id: str, values: list[float], nan_at: int | None = None
) -> bytes:
    """A DeviceUpdate frame; with `nan_at`, that float is NaN and the checksum still matches."""
    manifest, blob = pack_tensors({"w": torch.tensor(values)})
    if nan_at is not None:  # pack_tensors refuses NaN, as a sender's codec would: forge the bytes
        offset = len(blob) - 4 * (len(values) - nan_at)
        blob = blob[:offset] + struct.pack("<f", math.nan) + blob[offset + 4 :]
        manifest = manifest.model_copy(update={"sha256": hashlib.sha256(blob).hexdigest()})
    update = DeviceUpdate(
        run_id=RUN,
        round_id=round_id,
        device_id=device_id,
        algorithm="fedavg",
        num_samples=10,
        train_loss=0.5,
        manifest=manifest,
    )
    return encode_frame(update, blob)


def test_a_nan_update_is_rejected_counted_and_the_round_still_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = InProcessBroker()
    coordinator = Coordinator(
        broker.connect("coordinator"),
        build_strategy(FedAvgConfig(), 1.0),
        {"w": torch.zeros(3)},
        EngineSettings(rounds=1, quorum=0.5),
    )
    coordinator.run_id = RUN
    fleet = ScriptedFleet(
        broker,
        {
            "dev-a": lambda r, d: update_frame(r, d, [1.0, 2.0, 3.0]),
            "dev-b": lambda r, d: update_frame(r, d, [3.0, 2.0, 1.0]),
            "dev-nan": lambda r, d: update_frame(r, d, [1.0, 1.0, 1.0], nan_at=1),
        },
    )
    coordinator.start()
    fleet.hello()
    assert coordinator.wait_for_devices(3, 1.0)
    record = coordinator.run_round()
    assert coordinator.rejected == 1
    assert "'w' contains NaN or Inf" in caplog.text
    assert record.participants == 2
    torch.testing.assert_close(coordinator.model["w"], torch.tensor([2.0, 2.0, 2.0]))


# -- centered clipping (Karimireddy et al. 2021) against hand computations --


def test_centered_clipping_one_step_from_zero_is_the_mean_of_clipped_points() -> None:
    deltas = _deltas([1.0], [2.0], [100.0])
    # tau 3: clip(1) = 1, clip(2) = 2, clip(100) = 3 -> v = 6 / 3
    fixed = centered_clipping(deltas, tau=3.0)
    torch.testing.assert_close(fixed["w"], torch.tensor([2.0]))
    # tau None: the lower median distance from 0, 2 -> (1 + 2 + 2) / 3
    adaptive = centered_clipping(deltas)
    torch.testing.assert_close(adaptive["w"], torch.tensor([5.0 / 3.0]))


def test_centered_clipping_clips_whole_differences_around_the_center_and_iterates() -> None:
    center = {"w": torch.tensor([1.0, 1.0])}
    deltas = _deltas([1.0, 1.0], [4.0, 5.0], [1.0, 1.0])
    # differences (0, 0), (3, 4) with norm 5, (0, 0); tau 1 scales (3, 4) to (0.6, 0.8)
    once = centered_clipping(deltas, center, tau=1.0)
    torch.testing.assert_close(once["w"], torch.tensor([1.2, 1.0 + 0.8 / 3]))
    # a second step from v1: differences -(0.2, 0.8/3) twice (norm 1/3), and (2.8, 4 - 0.8/3)
    v1 = torch.tensor([1.2, 1.0 + 0.8 / 3], dtype=torch.float64)
    far = torch.tensor([4.0, 5.0], dtype=torch.float64) - v1
    expected = (
        v1 + (2 * (torch.tensor([1.0, 1.0], dtype=torch.float64) - v1) + far / far.norm()) / 3
    )
    twice = centered_clipping(deltas, center, tau=1.0, iterations=2)
    torch.testing.assert_close(twice["w"], expected.float())
    with pytest.raises(ValueError, match="iterations"):
        centered_clipping(deltas, iterations=0)
    with pytest.raises(ValueError, match="tau"):
        centered_clipping(deltas, tau=0.0)
    with pytest.raises(ValueError, match="at least one"):
        centered_clipping([])


def test_centered_clipping_bounds_any_liar_by_tau_over_n_and_refuses_counters() -> None:
    honest = [{"w": torch.zeros(4)} for _ in range(3)]
    liar = {"w": torch.full((4,), 1e9)}
    result = centered_clipping([*honest, liar], tau=0.5)
    assert float(torch.linalg.vector_norm(result["w"])) == pytest.approx(0.5 / 4)
    with pytest.raises(ValueError, match="counters, never averaged: n"):
        centered_clipping([{"w": torch.zeros(1), "n": torch.tensor(2)}] * 2, tau=0.5)


def test_fedavg_centered_clipping_keeps_its_history_in_the_state() -> None:
    config = FedAvgConfig(robust_aggregation="centered-clipping", cc_tau=1.0)
    strategy = build_strategy(config, 1.0)
    shared = {"w": torch.zeros(1)}
    first = [
        ReceivedUpdate(f"d{i}", 10, 0.0, {"w": torch.tensor([v])}) for i, v in enumerate([2.0, 2.0])
    ]
    moved = strategy.aggregate(1, shared, first).shared["w"]
    torch.testing.assert_close(moved, torch.tensor([1.0]))  # clip(2, 1) from 0
    state = strategy.state_dict()
    resumed = build_strategy(config, 1.0)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    second = [ReceivedUpdate(f"d{i}", 10, 0.0, {"w": torch.tensor([3.0])}) for i in range(2)]
    # from the center 1: 1 + clip(3 - 1, 1) = 2, in the original and the resumed strategy
    for each in (strategy, resumed):
        torch.testing.assert_close(
            each.aggregate(2, shared, second).shared["w"], torch.tensor([2.0])
        )
    with pytest.raises(ValueError, match="robust_center"):
        resumed.load_state_dict({"robust_center": [1.0]})
