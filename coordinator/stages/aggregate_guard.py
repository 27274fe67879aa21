"""Bounds on what one device's update can do to the fleet's model, checked before it is applied.

A device with valid credentials chooses its sample count and its delta. Before a strategy
aggregates, every update's count is capped at `max_count_ratio` times the round's lower median
count, more where the round's counts spread (so liars who collude cannot buy weight together),
then its weight (no device above
`max_weight_share` of the round's samples), and its norm is clipped to `norm_bound` times the
round's lower median norm; after, an
aggregate that is not finite, or moves the model by more than `max_growth` times its own norm,
is rejected: the round is redone without the updates the screen had to cut, and skipped if that
fails too. Robust aggregation (`robust_aggregation`, `clip_update_norm`) stays available per
algorithm for stronger threat models.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from coordinator.engine.once import OnceEach, kind_of
from coordinator.strategies.base import Aggregate, ReceivedUpdate, Strategy
from protocols.codec import Tensors
from protocols.privacy import clip_to_norm, update_norm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardSettings:
    """The bounds, each documented in docs/security.md with its flag."""

    max_samples: int = 100_000_000
    """The most training samples a device may declare in its hello."""
    max_count_ratio: float = 3.0
    """Count no device above this many times the round's lower median count (0 disables)."""
    count_spread_power: float = 4.0
    """Where counts spread out, the multiple widens to (Q3 / Q1) ** this (`count_limit`)."""
    max_weight_share: float = 0.5
    """No device's sample count weighs more than this share of a round's (1 disables)."""
    norm_bound: float = 4.0
    """Clip each update to this many times the round's lower median norm (0 disables).

    Honest digits updates measured up to 3.6x their round's lower median (docs/security.md)."""
    quarantine_after: int = 64
    """Dropped messages a device may have in one round before it sits out the rest (0: off)."""
    max_growth: float = 1000.0
    """Reject an aggregate moving the model by more than this times max(1, its norm)."""
    max_eval_loss: float = 1e6
    """The largest error (mse) an evaluation may report; accuracy is bounded by [0, 1]."""


@dataclass(frozen=True)
class Screened:
    """A round's updates after the screen, and why each cut one was cut."""

    updates: list[ReceivedUpdate]
    cut: dict[str, str] = field(default_factory=dict)
    norm_median: float = 0.0
    """The lower median of the updates' norms before clipping (what the clip bound scales)."""


def cap_shares(counts: Sequence[int], max_share: float) -> list[int]:
    """Counts lowered (largest first) until none exceeds `max_share` of their total.

    The cap T solves T = max_share * sum(min(c, T)) (water-filling); with fewer than 1/max_share
    non-zero counts the shares cannot all fit and every count becomes the smallest. One count,
    or all zero, is returned as is.
    """
    values = [int(c) for c in counts]
    positive = sorted((c for c in values if c > 0), reverse=True)
    if len(positive) < 2 or max_share >= 1 or positive[0] <= max_share * sum(positive):
        return values
    if max_share * len(positive) <= 1:
        return [min(c, positive[-1]) for c in values]
    cap = float(positive[0])
    rest = sum(positive)
    for capped in range(1, len(positive)):
        rest -= positive[capped - 1]
        cap = max_share * rest / (1 - max_share * capped)
        if cap >= positive[capped]:
            break
    limit = max(1, math.floor(cap))
    return [min(c, limit) for c in values]


def count_limit(counts: Sequence[int], max_ratio: float, spread_power: float) -> float:
    """The most a device's count may count for in a round: a multiple of its lower median.

    The multiple is `max_ratio`, or (Q3 / Q1) ** `spread_power` where the round's own counts are
    spread out (Q1, Q3: the lower and upper quartile of the positive counts, taken by rank), so a
    heavy-tailed honest fleet keeps its large devices whole while, in a fleet of similar devices,
    liars are held to `max_ratio` x the median. Fewer than a quarter of the counts cannot set a
    quartile, fewer than half not the median, to a count of their own (only shift it to another
    honest count). Infinite (no limit) when off or under two counts.
    """
    ordered = sorted(c for c in counts if c > 0)
    if max_ratio <= 0 or len(ordered) < 2:
        return math.inf
    last = len(ordered) - 1
    lower, median, upper = (ordered[(last * q) // 4] for q in (1, 2, 3))
    return median * max(max_ratio, math.pow(upper / lower, spread_power))


def cap_counts(counts: Sequence[int], max_ratio: float, spread_power: float) -> list[int]:
    """Counts lowered to `count_limit`: colluding liars cannot buy weight together.

    Unlike the share cap, the limit does not grow with what the others declare: m liars among
    n - m honest devices at the median c weigh at most m L / (m L + (n - m) c), with L the
    limit; L = k c (k = `max_ratio`) gives k f / (k f + 1 - f) for a fraction f = m / n.
    """
    values = [int(c) for c in counts]
    limit = count_limit(values, max_ratio, spread_power)
    if math.isinf(limit):
        return values
    bound = max(1, math.floor(limit))
    return [min(c, bound) for c in values]


def lower_median(values: Sequence[float]) -> float:
    """The median, the lower middle value for an even count: one large value cannot raise it."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def screen(updates: Sequence[ReceivedUpdate], settings: GuardSettings) -> Screened:
    """Cap the counts and weights and clip the norms of one round's updates (sorted by id)."""
    counts = [u.num_samples for u in updates]
    counts = cap_counts(counts, settings.max_count_ratio, settings.count_spread_power)
    counts = cap_shares(counts, settings.max_weight_share)
    cut: dict[str, str] = {}
    screened = []
    for update, count in zip(updates, counts, strict=True):
        if count == update.num_samples:
            screened.append(update)  # not capped: kept as it is
            continue
        cut[update.device_id] = f"weight capped from {update.num_samples} to {count} samples"
        screened.append(replace(update, num_samples=count))
    norms = [update_norm(u.shared_delta) for u in screened]
    median = lower_median(norms) if norms else 0.0
    if settings.norm_bound > 0 and len(screened) > 1:
        bound = settings.norm_bound * median
        for index, (update, norm) in enumerate(zip(screened, norms, strict=True)):
            if norm > bound > 0:
                clipped = clip_to_norm(update.shared_delta, bound)
                screened[index] = replace(update, shared_delta=clipped)
                reason = f"update norm {norm:.3g} clipped to {bound:.3g}"
                cut[update.device_id] = "; ".join(filter(None, (cut.get(update.device_id), reason)))
    return Screened(screened, cut, median)


def aggregate_problem(old: Tensors, new: Mapping[str, torch.Tensor], max_growth: float) -> str:
    """Why the aggregate `new` must not replace `old` ("" when it may)."""
    for name, value in new.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"the aggregate's {name} is not finite"
    change = update_norm({k: new[k].double() - old[k].double() for k in new if k in old})
    limit = max_growth * max(1.0, update_norm(old))
    if change > limit:
        return f"the aggregate moves the model by {change:.3g}, over the bound {limit:.3g}"
    return ""


@dataclass(frozen=True)
class Guarded:
    """A round's aggregate (None when skipped), and what the guard did."""

    aggregate: Aggregate | None
    cut: dict[str, str]
    rejected: str = ""
    norm_median: float = 0.0

    def scalars(self, round_id: int, notes: OnceEach) -> dict[str, float]:
        """The round's scalars: the aggregate's, and what the guard cut or rejected (logged).

        A cut is said once per device and kind of reason (`notes`); every round counts it.
        """
        for device_id, reason in self.cut.items():
            notes.warning((device_id, kind_of(reason)), f"round {round_id}: {device_id}: {reason}")
        scalars = dict(self.aggregate.scalars) if self.aggregate is not None else {}
        if self.aggregate is None:
            logger.error("round %d skipped, the model is unchanged: %s", round_id, self.rejected)
            scalars["aggregate_rejected"] = 1.0
        if self.cut:
            scalars["guard_cut"] = float(len(self.cut))
        return scalars


def guarded_aggregate(
    strategy: Strategy,
    round_id: int,
    shared: Tensors,
    updates: Sequence[ReceivedUpdate],
    settings: GuardSettings,
    *,
    restorable: bool = True,
) -> Guarded:
    """Screen, aggregate, check; redo once without the cut updates; skip if still rejected.

    A rejected aggregate never reaches the model, and with `restorable` the strategy's state
    (e.g. server optimizer moments) is restored to before it. A relay strategy (one model per
    device, kept inside it) is not copied each round: its broadcast template never changes.
    """
    screened = screen(updates, settings)
    attempts = [screened.updates]
    kept = [u for u in screened.updates if u.device_id not in screened.cut]
    if screened.cut and kept:
        attempts.append(kept)
    before = copy.deepcopy(strategy) if restorable else None
    problem = ""
    for attempt in attempts:
        aggregate = strategy.aggregate(round_id, shared, attempt)
        problem = aggregate_problem(shared, aggregate.shared, settings.max_growth)
        if not problem:
            return Guarded(aggregate, screened.cut, norm_median=screened.norm_median)
        logger.warning("round %d: %s; not applied", round_id, problem)
        if before is not None:
            strategy.load_state_dict(before.state_dict())
    return Guarded(None, screened.cut, problem, screened.norm_median)
