"""A secure round that fails is tried again without whoever it proved a liar, or skipped.

Never the end of the run. The round engine hands the secure-aggregation stage its selected
cohort and gets back the survivors' sum or a `SkippedRound`; the policy in between:

- fewer than 3 devices selected: skipped before any key is drawn. Drawing again until 3 come
  would change how cohorts are sampled, which DP's accountant assumes.
- a dealer whose shares rebuild another secret than it committed to is named (an offence),
  quarantined for the rest of the round and left out of the next attempt; so is every device
  that declined, went offline or was quarantined during an attempt.
- a failure before any sum is unmasked (too few answered a phase) is tried again, at most
  `retries` times, each time with fresh keys over the same trained updates.
- a sum unmasked and refused (out of what honest devices can send) ends the round at once:
  masking hides who sent it, and another attempt would unmask the same (noised) updates again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from coordinator.stages.accountant import DpRound
from coordinator.stages.base import Skipped
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.secure.aggregator import SecureAggregator, SecureRoundError
from coordinator.stages.secure.bounds import MIN_COHORT
from coordinator.stages.secure.unmask import SecureSum
from protocols.messages import SecureRound, TensorSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkippedRound:
    """A secure round that gave no sum to apply: the model stays as it was."""

    reason: str
    attempts: int
    unmasked: int
    """Devices in a sum the coordinator unmasked and refused (0: it saw no sum)."""
    excluded: tuple[str, ...]
    """Devices left out of a later attempt (named liars, declines, dropouts)."""

    def scalars(self) -> dict[str, float]:
        """The round record's view of it."""
        return {
            "secagg_skipped": 1.0,
            "secagg_attempts": float(self.attempts),
            "secagg_survivors": float(self.unmasked),
            "secagg_excluded": float(len(self.excluded)),
        }


@dataclass(frozen=True)
class SecureRequest:
    """What the engine asks of one secure round."""

    run_id: str
    round_id: int
    selected: tuple[str, ...]
    specs: Sequence[TensorSpec]
    train_timeout_s: float
    online: Callable[[], AbstractSet[str]]
    plan: Callable[[tuple[str, ...]], SecureRound]
    """The announcement's secure part for a cohort."""
    announce: Callable[[tuple[str, ...], SecureRound], None]
    hold: Callable[[str, str], None]
    """Quarantine a device for the rest of the round, with the reason."""


def secure_round(aggregator: SecureAggregator, request: SecureRequest) -> SecureSum | SkippedRound:
    """The survivors' sum after at most 1 + `retries` attempts, or why the round is skipped."""
    excluded: set[str] = set()
    reason, attempt = "", 0
    while attempt <= aggregator.settings.retries:
        online = request.online()
        cohort = tuple(d for d in request.selected if d not in excluded and d in online)
        if len(cohort) < MIN_COHORT:
            reason = (
                f"secure aggregation needs at least {MIN_COHORT} devices a round, "
                f"{len(cohort)} could take part: skipped"
            )
            break
        attempt += 1
        secure = request.plan(cohort)
        try:
            return aggregator.run(
                request.run_id,
                request.round_id,
                secure,
                cohort,
                request.specs,
                request.online,
                request.train_timeout_s,
                lambda: request.announce(cohort, secure),  # noqa: B023 (called within run)
            )
        except SecureRoundError as failure:
            reason = str(failure)
            for culprit in sorted(failure.culprits):
                request.hold(culprit, "dealt shares that do not rebuild its committed secret")
            excluded |= failure.culprits | failure.gone
            if failure.unmasked:
                return _skipped(request, reason, attempt, failure, excluded)
            logger.warning("round %d, attempt %d failed: %s", request.round_id, attempt, reason)
    return _skipped(request, reason, attempt, None, excluded)


def _skipped(
    request: SecureRequest,
    reason: str,
    attempts: int,
    refused: SecureRoundError | None,
    excluded: set[str],
) -> SkippedRound:
    logger.error("round %d skipped, the model is unchanged: %s", request.round_id, reason)
    unmasked = 0 if refused is None else refused.unmasked
    return SkippedRound(reason, attempts, unmasked, tuple(sorted(excluded)))


def account_skipped(
    privacy: PrivacyEngine, skipped: SkippedRound | Skipped, population: int, selected: int
) -> dict[str, float]:
    """What a skipped round costs under DP, told to the accountant; its privacy scalars.

    Every round drawn is counted once, at its planned noise: the skip itself tells that the draw
    (or what came of it) fell short, and a round that could have run is not drawn again. A sum
    unmasked and refused under device-placed noise was seen with only the noise of the devices in
    it, and is counted so (as `PrivacyEngine.finish` counts an applied one); under coordinator
    placement the coordinator, trusted with sums there, published nothing of it.
    """
    settings = privacy.settings
    poisson = settings.sampling == "poisson"
    cohort = max(privacy.participation * population if poisson else float(selected), 1.0)
    if skipped.unmasked and settings.placement == "device":
        return privacy.record(privacy.shares_round(skipped.unmasked, population, cohort))
    return privacy.record(DpRound(settings.noise_multiplier, population, cohort))
