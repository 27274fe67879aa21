"""Fair share over a whole asynchronous run: no device holds much more than its share of buffers.

The guard bounds one aggregation (a device's weight share, its norm). In buffered asynchronous
aggregation a device that answers fast is asked again as soon as it lands, so it can sit in most
buffers: with a buffer of K = 2 a fast liar holds half the weight of half the aggregations while
every single one stays within the guard's bounds. This stage counts, over the last `window`
aggregations, the buffer slots each device filled. With `a` aggregations in the window (the one
being filled included), each of K slots, among n devices that may be asked, a fair device holds
a K / n of them; its allowance is

    A = max(1, a x K / n)

A device that already holds `slack` x A slots is not asked until its oldest slot leaves the window
(deferred: its work is not dropped), and an update that makes its device hold h > A slots is scaled
by A / h, as a stale one is (`coordinator.scheduling.staleness`). So no device fills more than
`slack` x its fair share of the slots, and its updates weigh about A slots' worth. Honest fast
devices are held to the same bound, which costs some simulated time (the slower devices fill the
slots they would have taken; docs/results.md measures it); the floor of one slot keeps the first
aggregations of a run whole. When every candidate is deferred and nothing is in flight, those
holding the fewest slots are asked after all, so the rule never stalls a run.

`NO_FAIR_SHARE` is the null stage (`--fair-share 0`, and synchronous rounds). The window lives
with the scheduler's buffer and in-flight work: like them it is not checkpointed, and a resumed
run starts with an empty window.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Final, Protocol


def allowance(slack: float, aggregations: int, buffer: int, active: int) -> float:
    """Slots one of `active` devices may hold in `aggregations` buffers of `buffer`: at least 1."""
    if active <= 0:
        return float(max(1, aggregations * buffer))
    return max(1.0, slack * aggregations * buffer / active)


def fair_weight(held: int, limit: float) -> float:
    """The scale of an update that makes its device hold `held` slots against `limit`."""
    return 1.0 if held <= limit else limit / held


class FairShareStage(Protocol):
    """Whom to ask and how much an update counts, given the devices' recent buffer slots."""

    def admit(self, candidates: Sequence[str], active: int, *, idle: bool) -> list[str]:
        """The candidates under `slack` x their allowance; with `idle` never none of them."""
        ...

    def weight(self, device_id: str, active: int) -> float:
        """The scale of `device_id`'s update entering the buffer being filled (`active`: n)."""
        ...

    def record(self, device_ids: Iterable[str]) -> None:
        """One aggregation was made of these devices' updates."""
        ...


class NoFairShare:
    """The null stage: every candidate is asked, every update counts whole."""

    def admit(self, candidates: Sequence[str], active: int, *, idle: bool) -> list[str]:
        """`candidates` as they are."""
        return list(candidates)

    def weight(self, device_id: str, active: int) -> float:
        """1."""
        return 1.0

    def record(self, device_ids: Iterable[str]) -> None:
        """Nothing to remember."""


NO_FAIR_SHARE: Final = NoFairShare()


class FairShare:
    """Slots per device over the last `window` aggregations, weighed down above `slack` x fair.

    Args:
        slack: multiple of the fair share a device's updates may weigh (at least 1).
        window: aggregations remembered.
        buffer: updates per aggregation (K).
    """

    def __init__(self, slack: float, window: int, buffer: int) -> None:
        if slack < 1 or window < 1 or buffer < 1:
            msg = (
                f"fair share needs slack >= 1, window >= 1 and buffer >= 1; "
                f"got {slack}, {window}, {buffer}"
            )
            raise ValueError(msg)
        self.slack = slack
        self.buffer = buffer
        self.history: deque[tuple[str, ...]] = deque(maxlen=window)

    def slots(self) -> Counter[str]:
        """Each device's slots in the remembered aggregations."""
        return Counter(d for aggregation in self.history for d in aggregation)

    def admit(self, candidates: Sequence[str], active: int, *, idle: bool) -> list[str]:
        """Candidates holding fewer than `slack` x A slots; the others wait (are deferred).

        When all are deferred and nothing is in flight (`idle`), those holding the fewest
        slots: the rule defers work, it never stalls the run.
        """
        held = self.slots()
        limit = self.slack * allowance(1.0, len(self.history) + 1, self.buffer, active)
        admitted = [d for d in candidates if held[d] + 1 <= limit]
        if admitted or not idle or not candidates:
            return admitted
        fewest = min(held[d] for d in candidates)
        return [d for d in candidates if held[d] == fewest]

    def weight(self, device_id: str, active: int) -> float:
        """A / h for a device that would hold h > A slots with this update, else 1."""
        held = self.slots()[device_id] + 1
        limit = allowance(1.0, len(self.history) + 1, self.buffer, active)
        return fair_weight(held, limit)

    def record(self, device_ids: Iterable[str]) -> None:
        """Remember one aggregation's devices; the oldest leaves a full window."""
        self.history.append(tuple(sorted(device_ids)))
