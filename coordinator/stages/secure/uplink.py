"""The secure uplink path: a round's updates come in as one masked sum over its survivors.

It runs secure aggregation's phases (`coordinator.stages.secure.aggregator`), retrying or
skipping a failed round there (`coordinator.stages.secure.retry`), and hands the engine one
presummed update, or a `Skipped` round that leaves the model unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.stages.base import Collected, Skipped
from coordinator.stages.secure.aggregator import SecureAggregator
from coordinator.stages.secure.bounds import plan_round, weight_bound
from coordinator.stages.secure.retry import SecureRequest, SkippedRound, secure_round
from coordinator.stages.uplink import UplinkHost, UplinkRound, record_stragglers
from coordinator.strategies.base import RoundPlan
from protocols import secure_aggregation as sa
from protocols.messages import DeviceUpdate, SecureRound


def plan_cohort(
    settings: sa.SecureAggregationSettings,
    host: UplinkHost,
    request: UplinkRound,
    cohort: Sequence[str],
    needed: int,
) -> SecureRound:
    """The announcement's secure part for `cohort` of `request`'s plan, told to the stages.

    The weight bound caps the whole plan's declared counts (`weight_bound`).

    Raises:
        RoundError: fewer than 3 devices in `cohort`.
    """
    dp = request.privacy
    declared = [host.registry.declared_samples(d) for d in request.plan.devices]
    weights = weight_bound(host.strategy, declared, dp is not None, settings.max_weight_share)
    secure_round = plan_round(settings, cohort, dp, weights, needed)
    dimension = sum(math.prod(s.shape) for s in host.specs)
    host.stage.dealt(secure_round, dimension)  # the grid a discrete Gaussian counts on
    return secure_round


class SecureUplink:
    """Collects each round as a secure sum through `aggregator`."""

    shows_losses = False
    presums = True

    def __init__(self, aggregator: SecureAggregator) -> None:
        self.aggregator = aggregator

    def collect(self, host: UplinkHost, request: UplinkRound) -> Collected | Skipped:
        """Announce a secure round and run its phases: the survivors' sum, or a skip."""
        secure, plan, dp = self.aggregator, request.plan, request.privacy

        def announce(cohort: tuple[str, ...], secure_round: SecureRound) -> None:
            kept = RoundPlan(cohort, {d: plan.scalars[d] for d in cohort if d in plan.scalars})
            host.announce(request.round_id, "train", kept, privacy=dp, secure=secure_round)

        def plan_secure(cohort: tuple[str, ...]) -> SecureRound:
            needed = min(request.needed, len(cohort))
            return plan_cohort(secure.settings, host, request, cohort, needed)

        secure_request = SecureRequest(
            host.run_id,
            request.round_id,
            tuple(plan.devices),
            host.specs,
            host.settings.round_timeout_s,
            host.registry.online_ids,
            plan_secure,
            announce,
            host.hold,
        )
        sent_before = secure.bytes_down
        secure.late.clear()
        try:
            outcome = secure_round(secure, secure_request)
        finally:
            host.count_down(secure.bytes_down - sent_before)
            record_stragglers(host, request.round_id, secure.late, "a secure phase's deadline")
        if isinstance(outcome, SkippedRound):
            return Skipped(
                len(plan.devices), request.population, outcome.unmasked, outcome.scalars()
            )
        return Collected(
            [outcome.as_update(mean=dp is None)],
            participants=len(outcome.survivors),
            selected=len(plan.devices),
            within_clip=[outcome.within],
            presummed=True,
            reports_norm=False,
            scalars=outcome.scalars(),
        )

    def decline(self, device_id: str, round_id: int | None = None) -> None:
        """See `UplinkPath.decline`: no later phase of the round waits for it."""
        self.aggregator.decline(device_id, round_id)

    def takes_updates(self) -> bool:
        """See `UplinkPath.takes_updates`: masked updates while a secure round collects."""
        return self.aggregator.active()

    def on_update(self, update: DeviceUpdate, blob: bytes) -> None:
        """See `UplinkPath.on_update`: a masked update."""
        self.aggregator.on_update(update, blob)

    def on_message(self, topic: str, payload: bytes) -> None:
        """See `UplinkPath.on_message`: keys, shares or a reveal."""
        self.aggregator.on_message(topic, payload)
