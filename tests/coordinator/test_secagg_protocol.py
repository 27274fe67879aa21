"""Secure aggregation's protocol between the coordinator and devices, over a real broker hub.

Devices here are SecureClients with known deltas (no training), so the unmasked sum can be
checked exactly; some drop out, some lie. The coordinator side is the real SecureAggregator on
its own transport, its handlers guarded as the round engine guards them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from coordinator.stages.secure.aggregator import SecureAggregator
from coordinator.stages.secure.bounds import plan_round
from coordinator.stages.secure.unmask import SecureSum
from device_agent.secure_aggregation import SecureClient
from protocols import secure_aggregation as sa
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors, unpack_tensors
from protocols.errors import PflError, ProtocolError, RoundError
from protocols.messages import (
    DevicePrivacy,
    DeviceUpdate,
    Message,
    RevealedShare,
    RoundAnnouncement,
    SecAggKeys,
    SecAggReveal,
    SecAggShares,
    SecAggUnmask,
    SecureRound,
    TensorSpec,
)
from protocols.transport.inprocess import InProcessBroker, InProcessTransport

RUN = "ab" * 16
FLEET = "sec"
SPECS = (
    TensorSpec(name="layer.weight", dtype="float32", shape=(8, 16)),
    TensorSpec(name="layer.bias", dtype="float32", shape=(8,)),
)
Tweak = Callable[[Message], Message | None]
"""What a device does to a message before sending it (None: it drops out instead)."""


@dataclass
class Device:
    """A selected device with a fixed delta and sample count."""

    device_id: str
    delta: dict[str, torch.Tensor]
    samples: int
    transport: InProcessTransport
    client: SecureClient | None = None
    tweak: Tweak = lambda message: message
    masked_tweak: Callable[[np.ndarray], np.ndarray | None] = lambda vector: vector
    sent_masked: np.ndarray | None = None


@dataclass
class Harness:
    """A hub, the coordinator's aggregator, its devices, and what the coordinator saw."""

    broker: InProcessBroker
    aggregator: SecureAggregator
    devices: dict[str, Device]
    offences: list[tuple[str, str]] = field(default_factory=list)
    wiretap: dict[str, np.ndarray] = field(default_factory=dict)
    secure: SecureRound | None = None

    def run(
        self,
        weight_bound: int = 1,
        round_id: int = 1,
        quorum: int = 3,
        privacy: DevicePrivacy | None = None,
    ) -> SecureSum:
        ids = sorted(self.devices)
        secure = plan_round(self.aggregator.settings, ids, privacy, weight_bound, quorum)
        self.secure = secure
        announcement = RoundAnnouncement(
            run_id=RUN,
            round_id=round_id,
            phase="train",
            algorithm="fedavg",
            model_sha256="00" * 32,
            selected=tuple(ids),
            privacy=privacy,
            secure=secure,
        )
        coordinator = self.aggregator.transport
        return self.aggregator.run(
            RUN,
            round_id,
            secure,
            ids,
            SPECS,
            lambda: frozenset(ids),
            train_timeout_s=5.0,
            announce=lambda: coordinator.publish(
                topics.round_announcement(FLEET), encode_frame(announcement)
            ),
        )

    def plain_sum(self, survivors: tuple[str, ...], weighted: bool = False) -> np.ndarray:
        """What the survivors' clipped, weighted deltas sum to, in float64."""
        total = 0
        for device_id in survivors:
            device = self.devices[device_id]
            flat = _flat(device.delta)
            norm = np.linalg.norm(flat)
            clip = self.aggregator.settings.clip_norm
            flat = flat * min(1.0, clip / norm)
            total = total + flat * (device.samples if weighted else 1)
        return np.asarray(total)


def _flat(delta: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([delta[n].double().flatten() for n in sorted(delta)]).numpy()


def build(
    n: int,
    *,
    seed: int = 0,
    clip: float = 10.0,
    threshold: float = 0.6,
    neighbors: int = 0,
) -> Harness:
    broker = InProcessBroker()
    settings = sa.SecureAggregationSettings(
        clip_norm=clip, threshold=threshold, neighbors=neighbors, phase_timeout_s=5.0
    )
    offences: list[tuple[str, str]] = []
    coordinator = broker.connect("pfl-coordinator")
    aggregator = SecureAggregator(
        settings, coordinator, FLEET, lambda device, reason: offences.append((device, reason))
    )
    harness = Harness(broker, aggregator, {}, offences)

    def guarded(handler: Callable[[str, bytes], None]) -> Callable[[str, bytes], None]:
        def run(topic: str, payload: bytes) -> None:
            try:
                handler(topic, payload)
            except PflError as error:
                offences.append((topics.parse_topic(topic).device_id or "", str(error)))

        return run

    def on_update(topic: str, payload: bytes) -> None:
        update, blob = decode_frame(payload)
        assert isinstance(update, DeviceUpdate)
        masked = unpack_tensors(update.manifest, blob)["secagg.masked"]
        harness.wiretap[update.device_id] = masked.numpy().view(np.uint32).copy()
        aggregator.on_update(update, blob)

    coordinator.subscribe(
        topics.device_subscription(FLEET, "secagg"), guarded(aggregator.on_message)
    )
    coordinator.subscribe(topics.device_subscription(FLEET, "update"), guarded(on_update))
    rng = torch.Generator().manual_seed(seed)
    for index in range(n):
        device_id = f"dev-{index:02d}"
        delta = {s.name: torch.randn(s.shape, generator=rng) * 0.3 for s in SPECS}
        device = Device(device_id, delta, 10 + index, broker.connect(device_id))
        wire(device)
        harness.devices[device_id] = device
    return harness


def wire(device: Device) -> None:
    """Subscribe a device as the agent does: join on the round, act on secure messages."""
    state: dict[str, RoundAnnouncement] = {}

    def publish(message: Message) -> None:
        sent = device.tweak(message)
        if sent is not None:
            device.transport.publish(
                topics.device(FLEET, device.device_id, "secagg"), encode_frame(sent)
            )

    device.client = SecureClient(device.device_id, publish)

    def on_round(topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        state["round"] = announcement
        if device.tweak(announcement) is not None:
            device.client.join(announcement)  # type: ignore[union-attr]

    def on_secure(topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if device.client.receive(message):  # type: ignore[union-attr]
            announcement = state["round"]
            masked = device.client.mask(  # type: ignore[union-attr]
                announcement, device.delta, device.samples, 0.5, None
            )
            vector = device.masked_tweak(masked["secagg.masked"].numpy().view(np.uint32))
            if vector is None:
                return  # drops out after dealing, before its masked update
            device.sent_masked = vector
            tensors = {"secagg.masked": torch.from_numpy(vector.view(np.int32).copy())}
            manifest, blob = pack_tensors(tensors)
            update = DeviceUpdate(
                run_id=announcement.run_id,
                round_id=announcement.round_id,
                device_id=device.device_id,
                algorithm="fedavg",
                num_samples=1,
                train_loss=0.0,
                manifest=manifest,
            )
            device.transport.publish(
                topics.device(FLEET, device.device_id, "update"), encode_frame(update, blob)
            )

    device.transport.subscribe(topics.round_announcement(FLEET), on_round)
    device.transport.subscribe(topics.secure(FLEET), on_secure)
    device.transport.subscribe(topics.secure(FLEET, device.device_id), on_secure)


def fixed_point_error(harness: Harness, result: SecureSum, weight_bound: int = 1) -> float:
    """The documented bound on the sum's error per entry: m / (2 * scale)."""
    cohort = len(harness.devices)
    scale = sa.group_scale(weight_bound * harness.aggregator.settings.clip_norm, cohort)
    return cohort / (2 * scale)


def close_to(result: SecureSum, plain: np.ndarray, error: float) -> bool:
    """Within the fixed-point error, plus float32 rounding of the model's tensors."""
    return bool(np.all(np.abs(_total(result) - plain) <= error + np.abs(plain) * 2**-23))


def _total(result: SecureSum) -> np.ndarray:
    return _flat({n: t for n, t in result.total.items()})


# -- the sum, and only the sum ------------------------------------------------------------


def test_the_unmasked_sum_equals_the_plain_sum_within_the_fixed_point_error() -> None:
    harness = build(8)
    result = harness.run()
    assert result.survivors == tuple(sorted(harness.devices))
    assert not result.dropped
    plain = harness.plain_sum(result.survivors)
    assert close_to(result, plain, fixed_point_error(harness, result))
    assert result.weight == pytest.approx(8, abs=1e-6)
    assert harness.offences == []


def test_sample_weighted_sums_carry_the_total_weight_and_loss() -> None:
    harness = build(6)
    bound = max(d.samples for d in harness.devices.values())
    result = harness.run(weight_bound=bound)
    plain = harness.plain_sum(result.survivors, weighted=True)
    assert close_to(result, plain, fixed_point_error(harness, result, bound))
    assert result.weight == pytest.approx(
        sum(d.samples for d in harness.devices.values()), abs=0.01
    )
    assert result.loss == pytest.approx(0.5, abs=1e-4)
    update = result.as_update(mean=True)
    mean = _flat(dict(update.shared_delta))
    assert np.allclose(mean, plain / result.weight, atol=1e-5)


def test_updates_beyond_the_clip_norm_are_clipped_and_counted() -> None:
    harness = build(5, clip=0.5)
    result = harness.run()
    assert result.clipped == 5  # every random delta here has a norm of about 3.5
    assert np.linalg.norm(_total(result)) <= 5 * 0.5 + 1e-4


def test_a_wiretap_on_the_coordinator_sees_uniform_values_independent_of_the_updates() -> None:
    harness = build(6)
    result = harness.run()
    assert harness.secure is not None
    layout = sa.secure_layout(harness.secure, 136, dp_bit=False)
    pooled = np.concatenate(list(harness.wiretap.values()))
    # uniform over Z_(2^32): each of 16 buckets of the top 4 bits holds about 1/16
    counts = np.bincount(pooled >> 28, minlength=16)
    expected = pooled.size / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40  # 15 degrees of freedom: p < 0.001 above 37.7
    for device_id, seen in harness.wiretap.items():
        device = harness.devices[device_id]
        flat = _flat(device.delta)
        clipped = flat * min(1.0, 10 / np.linalg.norm(flat))
        truth = sa.encode(np.concatenate([clipped, [1.0, 0.5, 0.0]]), layout)
        r = np.corrcoef(truth.view(np.int32).astype(float), seen.view(np.int32).astype(float))[0, 1]
        assert abs(r) < 0.35  # 139 entries: |r| above 0.35 has p < 1e-4 for independent values
    assert result.survivors


def test_masks_differ_every_round_even_for_the_same_update() -> None:
    harness = build(4)
    harness.run(round_id=1)
    first = dict(harness.wiretap)
    harness.run(round_id=2)
    for device_id, seen in harness.wiretap.items():
        assert not np.array_equal(seen, first[device_id])


# -- dropouts ---------------------------------------------------------------------------


def test_thirty_percent_dropping_after_dealing_still_gives_the_exact_sum_of_the_survivors() -> None:
    harness = build(10)
    for device_id in ("dev-01", "dev-04", "dev-08"):  # 3 of 10 never send a masked update
        harness.devices[device_id].masked_tweak = lambda vector: None
    result = harness.run()
    assert result.dropped == ("dev-01", "dev-04", "dev-08")
    assert len(result.survivors) == 7
    plain = harness.plain_sum(result.survivors)
    assert close_to(result, plain, fixed_point_error(harness, result))
    assert harness.offences == []


def test_dropouts_with_a_sparse_neighbour_ring_are_recovered_too() -> None:
    harness = build(16, neighbors=6)  # each needs 4 of its 6 neighbours: 2 may drop anywhere
    for device_id in ("dev-00", "dev-11"):
        harness.devices[device_id].masked_tweak = lambda vector: None
    result = harness.run()
    plain = harness.plain_sum(result.survivors)
    assert len(result.survivors) == 14
    assert close_to(result, plain, fixed_point_error(harness, result))


def test_devices_that_never_deal_are_left_out_before_anyone_masks_with_them() -> None:
    harness = build(6)

    def no_shares(message: Message) -> Message | None:
        return None if isinstance(message, SecAggShares) else message

    harness.devices["dev-02"].tweak = no_shares
    result = harness.run()
    assert "dev-02" not in result.survivors
    assert "dev-02" not in result.dropped
    plain = harness.plain_sum(result.survivors)
    assert close_to(result, plain, fixed_point_error(harness, result))


def test_too_many_dropouts_fail_the_round_rather_than_expose_anyone() -> None:
    harness = build(5)
    for device_id in ("dev-00", "dev-01", "dev-02"):
        harness.devices[device_id].masked_tweak = lambda vector: None
    with pytest.raises(RoundError, match="only 2 devices masked updates"):
        harness.run()


# -- lying devices ----------------------------------------------------------------------


def test_a_holder_revealing_a_false_share_is_named_and_the_sum_still_comes_out() -> None:
    harness = build(8)

    def lie(message: Message) -> Message | None:
        if isinstance(message, SecAggReveal) and message.shares:
            first = message.shares[0]
            forged = RevealedShare(
                dealer=first.dealer, secret=first.secret, share="11" * 66, salt=first.salt
            )
            return message.model_copy(update={"shares": (forged, *message.shares[1:])})
        return message

    harness.devices["dev-03"].tweak = lie
    result = harness.run()
    assert any(device == "dev-03" and "other than the one dealt" in reason
               for device, reason in harness.offences)  # fmt: skip
    plain = harness.plain_sum(result.survivors)
    assert close_to(result, plain, fixed_point_error(harness, result))


def test_a_dealer_whose_shares_rebuild_another_seed_is_named_and_the_round_refused() -> None:
    harness = build(6)
    liar = harness.devices["dev-02"]

    def swap_seed_after_committing(message: Message) -> Message | None:
        if isinstance(message, SecAggKeys):
            liar.client._round.seed = secrets.token_bytes(32)  # type: ignore[union-attr]
        return message

    liar.tweak = swap_seed_after_committing
    with pytest.raises(RoundError, match="dev-02 dealt shares that do not rebuild the seed"):
        harness.run()
    assert [device for device, _ in harness.offences] == ["dev-02"]


def test_an_out_of_range_masked_update_is_detected_in_the_sum() -> None:
    harness = build(6)

    def inflate(vector: np.ndarray) -> np.ndarray:
        out: np.ndarray = vector.copy()
        out[:136] += np.uint32(2**29)  # what masking hides: a huge update, 15 in every entry
        return out

    harness.devices["dev-04"].masked_tweak = inflate
    with pytest.raises(RoundError, match="no 6 honest devices send that"):
        harness.run()


def test_a_low_order_key_is_refused_at_the_keys_step_and_the_round_goes_on() -> None:
    harness = build(6)

    def bad_key(message: Message) -> Message | None:
        if isinstance(message, SecAggKeys):
            return message.model_copy(update={"mask_key": "00" * 32})
        return message

    harness.devices["dev-05"].tweak = bad_key
    result = harness.run()
    assert "dev-05" not in result.survivors
    assert any(device == "dev-05" and "low-order" in reason for device, reason in harness.offences)


def test_a_device_never_reveals_both_secrets_of_one_dealer_even_when_asked_twice() -> None:
    harness = build(5)
    result = harness.run()
    client = harness.devices["dev-00"].client
    assert client is not None
    # the same round asked again with dev-01 dropped: its seed share went out already
    client._round.revealed_for = result.survivors  # type: ignore[union-attr]
    survivors = tuple(d for d in result.survivors if d != "dev-01")
    with pytest.raises(ProtocolError, match="asked again with other survivors"):
        client.receive(SecAggUnmask(run_id=RUN, round_id=1, survivors=survivors))


def test_a_device_refuses_an_unmasking_of_too_few_survivors() -> None:
    harness = build(5)
    client = harness.devices["dev-00"].client
    assert client is not None
    for device_id in ("dev-02", "dev-03", "dev-04"):
        harness.devices[device_id].masked_tweak = lambda vector: None
    with pytest.raises(RoundError):  # the round fails: all devices but two drop
        harness.run()
    unmask = SecAggUnmask(run_id=RUN, round_id=1, survivors=("dev-00", "dev-01"))
    with pytest.raises(ProtocolError, match="could expose one device"):
        client.receive(unmask)
