"""What a secure round announces: cohort minimum, weight bound, value and noise bounds."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.stages.aggregate_guard import cap_shares
from coordinator.strategies.base import Strategy
from protocols import secure_aggregation as sa
from protocols.errors import RoundError
from protocols.messages import DevicePrivacy, SecureRound

MIN_COHORT = 3
"""Fewer devices never aggregate securely: the sum of two tells each the other's update."""
NOISE_ROOM = 8.0
"""Each entry's clamp leaves this many noise standard deviations above the clip norm."""


def weight_bound(
    strategy: Strategy, declared: Sequence[int | None], private: bool, max_share: float
) -> int:
    """The largest weight a device may give its update: 1 for a uniform mean, else samples.

    Capped by water-filling the cohort's declared counts (`cap_shares`), as plain rounds cap
    the counts their updates claim: a hello declaring a huge data set cannot make its masked
    update outweigh the rest, nor coarsen everyone's fixed point with a huge bound.
    """
    if private or strategy.config.weighs_equally():
        return 1
    counts = [d for d in declared if d is not None and d > 0]
    return max([1, *cap_shares(counts, max_share)])


def plan_round(
    settings: sa.SecureAggregationSettings,
    selected: Sequence[str],
    privacy: DevicePrivacy | None,
    weights: int,
    needed: int,
) -> SecureRound:
    """What the round's announcement tells devices.

    Raises:
        RoundError: fewer than 3 devices selected (a sum of two tells each the other's).
    """
    if len(selected) < MIN_COHORT:
        msg = (
            f"secure aggregation needs at least 3 devices a round, {len(selected)} selected: "
            "the sum of two would tell each device the other's update"
        )
        raise RoundError(msg)
    noise = privacy.noise_std if privacy is not None else 0.0
    clip = privacy.clip_norm if privacy is not None else settings.clip_norm
    return SecureRound(
        threshold=settings.threshold,
        neighbors=settings.neighbors,
        cohort=len(selected),
        min_survivors=max(MIN_COHORT, needed),
        clip_norm=clip,
        value_bound=clip + NOISE_ROOM * noise,
        weight_bound=weights,
        loss_bound=0.0 if privacy is not None else settings.loss_bound,
        bit_bound=(
            1 + NOISE_ROOM * privacy.indicator_std
            if privacy is not None and privacy.report_clipped
            else 0.0
        ),
        phase_timeout_s=settings.phase_timeout_s,
        int8=settings.int8,
    )
