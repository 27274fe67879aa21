"""The coordinator's uplink path with an aggregator tier: partial aggregates in, one sum out.

The engine's round is unchanged: this `UplinkPath` publishes the round's tier plan, announces
the round, and waits until every asked device is covered by a partial aggregate, declined or
went offline, or the deadline; then it closes the round for the aggregators still holding one
and waits `grace` for them. An aggregator that never answers loses its group's contribution for
that round only: the round completes if the partials cover the quorum. It hands the engine one
presummed update, as secure aggregation does: the weighted mean of every group's sum (under
DP: the sum of clipped updates, noised once by the privacy stage and accounted as today).

The coordinator does not read device updates with the tier on: the path unsubscribes the
engine's update topic. A partial is checked like an update: from a listed aggregator (the topic
names it, the broker's ACL lets only that account write it), this run and round, the first one
per aggregator and round (replays are dropped), devices that were asked and that no other
partial covers, a weight and sample count within the devices' declared counts, finite sums of
the run's layout whose norm is within weight x clip.

With secure aggregation (`secure`), the announcement carries one secure round for the whole
cohort (its ring and weight bound), with the protocol's minimum of 3 survivors, which each
group's round must reach; each aggregator runs the protocol within its group
(`coordinator.tier.secure_group`) and sends its group's unmasked sum. The coordinator waits for
the training and the three short phases (keys, shares, reveal), and allows each sum the
fixed-point rounding of its devices on top of weight x clip.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

import torch

from coordinator.engine.intake import Collector
from coordinator.stages.base import Collected, Skipped
from coordinator.stages.secure.bounds import MIN_COHORT
from coordinator.stages.secure.uplink import plan_cohort
from coordinator.stages.uplink import UplinkHost, UplinkRound
from coordinator.strategies.base import ReceivedUpdate
from coordinator.tier import wire
from coordinator.tier.settings import TierSettings
from protocols import secure_aggregation as sa
from protocols import topics
from protocols.codec import Tensors
from protocols.errors import PflError, ProtocolError, RoundError, describe
from protocols.messages import DevicePrivacy, DeviceUpdate, SecureRound, TensorSpec
from protocols.privacy import update_norm
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)
_NORM_SLACK = 1e-9
"""Relative slack of the norm bound: a sum of clipped float64 deltas rounds a little."""


class TierUplink:
    """Collects each round as partial aggregates from the listed aggregators."""

    shows_losses = False
    presums = True

    def __init__(
        self,
        transport: Transport,
        fleet: str,
        aggregators: Sequence[str],
        clip_norm: float,
        grace_s: float,
        max_frame_bytes: int = 256 * 1024 * 1024,
        secure: sa.SecureAggregationSettings | None = None,
    ) -> None:
        self.transport = transport
        self.secure = secure
        self.fleet = fleet
        self.aggregators = tuple(sorted(aggregators))
        self.clip_norm = clip_norm
        self.grace_s = grace_s
        self.max_frame_bytes = max_frame_bytes
        self.bytes_in = 0
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        self._open: tuple[str, int, UplinkRound, UplinkHost] | None = None
        self._collector: Collector[str] | None = None
        self._partials: dict[str, tuple[wire.PartialAggregate, Tensors]] = {}
        self._secure_round: SecureRound | None = None
        self._reading_updates = True
        transport.subscribe(wire.partial_subscription(fleet), self._on_partial)

    def collect(self, host: UplinkHost, request: UplinkRound) -> Collected | Skipped:
        """Plan, announce, wait for the partials; one presummed update of what came in.

        Raises:
            RoundError: the partials cover fewer devices than the quorum.
        """
        if self._reading_updates:  # devices' updates (and secure messages): the aggregators'
            for kind in ("update", "secagg"):
                self.transport.unsubscribe(topics.device_subscription(self.fleet, kind))
            self._reading_updates = False
        round_id, plan, dp = request.round_id, request.plan, request.privacy
        secure: SecureRound | None = None
        if self.secure is not None:
            if len(plan.devices) < MIN_COHORT:
                return Skipped(len(plan.devices), request.population, 0, {"secagg_skipped": 1.0})
            secure = plan_cohort(self.secure, host, request, plan.devices, MIN_COHORT)
        equal = dp is not None or host.strategy.config.weighs_equally()
        tier_plan = wire.TierPlan(
            run_id=host.run_id,
            round_id=round_id,
            algorithm=host.strategy.name,
            specs=host.specs,
            declared={
                d: n for d in plan.devices if (n := host.registry.declared_samples(d)) is not None
            },
            equal_weights=equal,
            clip_norm=self._clip(dp, secure),
            privacy=dp,
            train_timeout_s=host.settings.round_timeout_s,
        )
        collector: Collector[str] = Collector(round_id, "train", set(plan.devices))
        with self._lock:
            self._open, self._collector, self._partials = (
                (host.run_id, round_id, request, host),
                collector,
                {},
            )
            self._secure_round = secure
        self.transport.publish(wire.plan_topic(self.fleet), wire.encode(tier_plan), retain=True)
        host.announce(round_id, "train", plan, privacy=dp, secure=secure)
        # every partial in, or no asked device left to cover; not the engine's silent-device
        # grace: a device's update never reaches the coordinator to show it is heard again
        online = host.registry.online_ids
        phases = 0.0 if secure is None else 3 * secure.phase_timeout_s  # keys, shares, reveal
        self.transport.wait_until(
            lambda: self._all_in() or collector.settled(online()),
            host.settings.round_timeout_s + phases,
        )
        if not self._all_in():
            close = wire.TierClose(run_id=host.run_id, round_id=round_id)
            self.transport.publish(wire.close_topic(self.fleet), wire.encode(close))
            self.transport.wait_until(self._all_in, self.grace_s)
        with self._lock:
            partials, self._open, self._collector = dict(self._partials), None, None
        return self._combined(
            round_id,
            request,
            partials,
            host.specs,
            mean=dp is None,
            declined=len(collector.declined),
        )

    def _clip(self, dp: DevicePrivacy | None, secure: SecureRound | None) -> float:
        """The norm each update is clipped to: the secure round's, DP's, or the tier's."""
        if secure is not None:
            return secure.clip_norm
        return self.clip_norm if dp is None else dp.clip_norm

    def _all_in(self) -> bool:
        with self._lock:
            return len(self._partials) >= len(self.aggregators)

    def _combined(
        self,
        round_id: int,
        request: UplinkRound,
        partials: dict[str, tuple[wire.PartialAggregate, Tensors]],
        specs: tuple[TensorSpec, ...],
        *,
        mean: bool,
        declined: int,
    ) -> Collected:
        covered = sum(len(p.devices) for p, _ in partials.values())
        selected = len(request.plan.devices)
        if covered < request.needed:
            lost = sorted(set(self.aggregators) - set(partials))
            msg = (
                f"partial aggregates cover {covered} of {selected} devices (quorum "
                f"{request.needed}); no partial from {', '.join(lost) or 'none missing'}"
            )
            raise RoundError(msg, round_id=round_id)
        total = {s.name: torch.zeros(s.shape, dtype=torch.float64) for s in specs}
        weight, samples, loss_sum, bits = 0.0, 0, 0.0, []
        for name in sorted(partials):  # aggregator order: deterministic
            partial, sums = partials[name]
            for tensor_name, tensor in sums.items():
                total[tensor_name].add_(tensor)
            weight, samples = weight + partial.weight, samples + partial.samples
            loss_sum += partial.loss_sum
            bits.append(partial.within_clip)
        scale = 1 / weight if mean and weight > 0 else 1.0
        dtypes = {s.name: s.dtype for s in specs}
        delta = {n: _as_dtype(t * scale, getattr(torch, dtypes[n])) for n, t in total.items()}
        loss = loss_sum / samples if samples else 0.0
        within = sum(b for b in bits if b is not None) if any(b is not None for b in bits) else None
        missing = sorted(set(self.aggregators) - set(partials))
        if missing:
            logger.warning("round %d closed without partials from %s", round_id, ", ".join(missing))
        return Collected(
            [ReceivedUpdate("tier-sum", max(1, round(weight)), loss, delta)],
            participants=covered,
            selected=selected,
            within_clip=[within],
            declined=declined,
            presummed=True,
            reports_norm=False,
            scalars={"tier_partials": float(len(partials)), "tier_missing": float(len(missing))},
        )

    def _on_partial(self, topic: str, payload: bytes) -> None:
        """Check and keep one partial; a bad one is dropped whole, with its reason logged."""
        self.bytes_in += len(payload)
        try:
            self._take(topic, payload)
        except PflError as error:
            self._reject(topic, str(error))
        except Exception as error:  # an input no validator caught: drop it, stay up
            self._reject(topic, describe(error))

    def _reject(self, topic: str, reason: str) -> None:
        self.rejected.append(reason)
        logger.warning("dropped the partial aggregate on %s: %s", topic, reason)

    def _take(self, topic: str, payload: bytes) -> None:
        partial, blob = wire.decode(payload, self.max_frame_bytes)
        if not isinstance(partial, wire.PartialAggregate):
            msg = "not a partial aggregate"
            raise ProtocolError(msg, topic=topic)
        if topic != wire.partial_topic(self.fleet, partial.aggregator):
            msg = f"aggregator {partial.aggregator!r} does not match its topic"
            raise ProtocolError(msg, topic=topic)
        if partial.aggregator not in self.aggregators:
            msg = f"aggregator {partial.aggregator!r} is not one of this run's"
            raise ProtocolError(msg, topic=topic)
        with self._lock:
            if self._open is None or self._collector is None:
                msg = f"partial for round {partial.round_id}, but no round is open"
                raise RoundError(msg, topic=topic)
            run_id, round_id, request, host = self._open
            if (partial.run_id, partial.round_id) != (run_id, round_id):
                msg = f"stale partial (run {partial.run_id[:8]}, round {partial.round_id})"
                raise RoundError(msg, topic=topic)
            if partial.aggregator in self._partials:
                msg = f"a second partial from {partial.aggregator} for round {round_id}"
                raise RoundError(msg, topic=topic)
            self._check_devices(partial, request, host)
            sums = wire.partial_sums(partial, blob, host.specs)
            secure = self._secure_round
            bound = partial.weight * self._clip(request.privacy, secure) * (1 + _NORM_SLACK)
            if secure is not None:  # each device's fixed-point rounding, at most a step a value
                dimension = sum(math.prod(s.shape) for s in host.specs)
                bound += len(partial.devices) * math.sqrt(dimension) / sa.delta_scale(secure)
            norm = update_norm(sums)
            if not math.isfinite(norm) or norm > bound:
                msg = f"partial norm {norm:g} over weight x clip (bound {bound:g})"
                raise ProtocolError(msg, topic=topic)
            if (
                partial.within_clip is not None
                and abs(partial.within_clip) > len(partial.devices) + 1e6
            ):
                msg = "partial's within-clip sum is out of range"
                raise ProtocolError(msg, topic=topic)
            self._partials[partial.aggregator] = (partial, sums)
            for device_id in partial.devices:
                self._collector.offer(device_id, partial.aggregator)

    def _check_devices(
        self, partial: wire.PartialAggregate, request: UplinkRound, host: UplinkHost
    ) -> None:
        devices = partial.devices
        if list(devices) != sorted(set(devices)):
            msg = "a partial's devices must be sorted and each listed once"
            raise ProtocolError(msg)
        asked = set(request.plan.devices)
        covered = {d for p, _ in self._partials.values() for d in p.devices}
        strangers = [d for d in devices if d not in asked or d in covered]
        if strangers:
            msg = f"devices not asked this round or already covered: {', '.join(strangers[:5])}"
            raise ProtocolError(msg)
        declared = sum(host.registry.declared_samples(d) or 0 for d in devices)
        equal = request.privacy is not None or host.strategy.config.weighs_equally()
        cap = float(len(devices)) if equal else float(declared)
        if partial.samples > declared or partial.weight > cap:
            msg = (
                f"partial claims weight {partial.weight:g} and {partial.samples} samples; its "
                f"devices declared {declared}"
            )
            raise ProtocolError(msg)

    def decline(self, device_id: str, round_id: int | None = None) -> None:
        """See `UplinkPath.decline`: the round stops waiting for it."""
        with self._lock:
            collector, opened = self._collector, self._open
        if collector is not None and opened is not None and round_id in (None, opened[1]):
            collector.decline(device_id)

    def takes_updates(self) -> bool:
        """See `UplinkPath.takes_updates`: updates are the aggregators' (none reach here)."""
        return True

    def on_update(self, update: DeviceUpdate, blob: bytes) -> None:
        """See `UplinkPath.on_update`: an update that reached the coordinator is not read."""
        del blob
        logger.debug("ignored update from %s: the tier aggregates it", update.device_id)

    def on_message(self, topic: str, payload: bytes) -> None:
        """See `UplinkPath.on_message`.

        Raises:
            RoundError: always: this path has no device protocol of its own.
        """
        msg = "secure aggregation message, but this run aggregates through the tier"
        raise RoundError(msg, topic=topic)


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if dtype.is_floating_point else tensor.round().to(dtype)


def tier_uplink(
    settings: TierSettings,
    transport: Transport,
    fleet: str,
    secure: sa.SecureAggregationSettings | None = None,
) -> TierUplink:
    """The run's tier path from its settings (`secure`: secure aggregation within each group)."""
    return TierUplink(
        transport,
        fleet,
        settings.aggregators,
        settings.clip_norm,
        settings.grace_s,
        secure=secure,
    )
