"""The fleet registry: which devices exist, whether they are online, and what they last said."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from coordinator.strategies.base import DeviceInfo, FleetSnapshot
from protocols.messages import DeviceHello, DeviceStatus


@dataclass(frozen=True)
class DeviceRecord:
    """The latest the coordinator heard from one device."""

    device_id: str
    online: bool
    last_seen: float
    num_train_samples: int = 0
    hello: DeviceHello | None = None
    round_id: int | None = None
    last_loss: float | None = None
    detail: str = ""
    rounds_taken: int = 0
    taken_round: int | None = None
    declines: int = 0
    last_decline: str = ""


@dataclass
class DeviceUsage:
    """What one device cost and how quickly it answered: for the fleet status's stragglers."""

    bytes_up: int = 0
    bytes_down: int = 0
    round_seconds: float | None = None
    """From the last training announcement to this device's update for it."""
    missed_deadlines: int = 0
    """Rounds it was selected for and let the deadline pass while connected."""
    missed_round: int | None = None


class FleetRegistry:
    """Thread-safe: transport handlers write, the round engine reads.

    Args:
        keeps_losses: record each device's last loss (the fleet status republishes it to every
            device); False under DP or secure aggregation, where no exact loss may be shown.
    """

    def __init__(self, *, keeps_losses: bool = True) -> None:
        self.keeps_losses = keeps_losses
        self._lock = threading.Lock()
        self._devices: dict[str, DeviceRecord] = {}
        self._online: set[str] = set()  # kept as records change, under the lock
        self._online_view: frozenset[str] | None = frozenset()  # readers' copy; None: stale
        self.online_copies = 0
        """Copies of the online set made for readers: one per change that is read, not per hello
        (copying on every hello made registering n devices O(n^2))."""
        self._usage: dict[str, DeviceUsage] = {}
        self._asked: tuple[int, float] = (-1, 0.0)  # the last training round announced, when

    def on_hello(self, hello: DeviceHello) -> bool:
        """A device (re)joined: it is online and eligible from the next round on.

        True when the id is online under another running instance of the agent (a clash).
        """
        with self._lock:
            previous = self._devices.get(hello.device_id)
            before = previous.hello if previous is not None and previous.online else None
            clash = (
                before is not None
                and before.instance != hello.instance
                and "" not in (before.instance, hello.instance)
            )
            base = previous or DeviceRecord(hello.device_id, True, time.time())
            self._store(
                replace(
                    base,
                    online=True,
                    last_seen=time.time(),
                    num_train_samples=hello.num_train_samples,
                    hello=hello,
                )
            )
        return clash

    def on_status(self, status: DeviceStatus) -> None:
        """Track liveness; an "offline" status (often the broker's last-will) excludes a device."""
        with self._lock:
            previous = self._devices.get(status.device_id)
            if previous is None and status.state == "offline":
                return
            base = previous or DeviceRecord(status.device_id, True, time.time())
            declined = status.state == "skipped"
            self._store(
                replace(
                    base,
                    online=status.state != "offline" and base.hello is not None,
                    last_seen=time.time(),
                    round_id=status.round_id if status.round_id is not None else base.round_id,
                    last_loss=self._loss(status.last_loss, base.last_loss),
                    detail=status.detail,
                    declines=base.declines + declined,
                    last_decline=status.detail if declined else base.last_decline,
                )
            )

    def on_update(self, device_id: str, round_id: int, train_loss: float | None) -> None:
        """Progress learned from an update, so devices need not send a status every round.

        A round counts once among the rounds it took part in, however often it is re-sent.
        """
        with self._lock:
            previous = self._devices.get(device_id)
            if previous is not None:
                taken = previous.rounds_taken + (previous.taken_round != round_id)
                self._store(
                    replace(
                        previous,
                        last_seen=time.time(),
                        round_id=round_id,
                        last_loss=self._loss(train_loss, None),
                        rounds_taken=taken,
                        taken_round=round_id,
                    )
                )
                if round_id == self._asked[0]:
                    usage = self._usage.setdefault(device_id, DeviceUsage())
                    usage.round_seconds = max(0.0, time.time() - self._asked[1])

    def _loss(self, reported: float | None, previous: float | None) -> float | None:
        """The loss to record: the one reported, else the one before (None: not kept)."""
        if not self.keeps_losses:
            return None
        return reported if reported is not None else previous

    def asked(self, round_id: int) -> None:
        """Training round `round_id` was announced now: answers to it time from here."""
        with self._lock:
            self._asked = (round_id, time.time())

    def missed_deadline(self, round_id: int, device_ids: Iterable[str]) -> None:
        """`device_ids` were selected for `round_id`, stayed connected, and did not answer."""
        with self._lock:
            for device_id in device_ids:
                usage = self._usage.setdefault(device_id, DeviceUsage())
                usage.missed_deadlines += 1
                usage.missed_round = round_id

    def count_up(self, device_id: str, size: int) -> None:
        """`size` payload bytes arrived from `device_id` (counted only for a known device)."""
        with self._lock:
            if device_id in self._devices:
                self._usage.setdefault(device_id, DeviceUsage()).bytes_up += size

    def count_down(self, sizes: Mapping[str, int]) -> int:
        """Payload bytes sent for each device (its downloads; known devices): their total."""
        with self._lock:
            for device_id, size in sizes.items():
                if device_id in self._devices:
                    self._usage.setdefault(device_id, DeviceUsage()).bytes_down += size
        return sum(sizes.values())

    def count_broadcast(self, size: int) -> int:
        """A broadcast of `size` bytes, which each device online now receives: their total."""
        return self.count_down(dict.fromkeys(self.online_ids(), size))

    def usage(self) -> dict[str, DeviceUsage]:
        """Each device's bytes and round time so far (copies)."""
        with self._lock:
            return {d: replace(u) for d, u in self._usage.items()}

    def knows(self, device_id: str) -> bool:
        """Whether the device ever said hello."""
        with self._lock:
            record = self._devices.get(device_id)
            return record is not None and record.hello is not None

    def declared_samples(self, device_id: str) -> int | None:
        """The training samples the device declared in its hello (None before any hello)."""
        with self._lock:
            record = self._devices.get(device_id)
            return record.hello.num_train_samples if record and record.hello else None

    def online_count(self) -> int:
        """How many devices can take part now."""
        return len(self._online)

    def online_ids(self) -> frozenset[str]:
        """Ids of the devices that can take part now, copied only after a change.

        O(1) unless the set changed since the last read: a round checks it per message, while
        hellos arrive in bursts.
        """
        view = self._online_view
        if view is None:
            with self._lock:
                if self._online_view is None:
                    self._online_view = frozenset(self._online)
                    self.online_copies += 1
                view = self._online_view
        return view

    def _store(self, record: DeviceRecord) -> None:
        """Keep `record` (under the lock) and the online set with it."""
        self._devices[record.device_id] = record
        if record.online != (record.device_id in self._online):
            if record.online:
                self._online.add(record.device_id)
            else:
                self._online.discard(record.device_id)
            self._online_view = None

    def restore(self, device_id: str, num_train_samples: int) -> None:
        """A device known from a checkpoint: offline and not selectable until it says hello."""
        with self._lock:
            if device_id not in self._devices:
                self._store(
                    DeviceRecord(device_id, False, time.time(), num_train_samples=num_train_samples)
                )

    def records(self) -> list[DeviceRecord]:
        """Every known device, sorted by id."""
        with self._lock:
            return [self._devices[key] for key in sorted(self._devices)]

    def snapshot(self) -> FleetSnapshot:
        """The planning view of the fleet."""
        return FleetSnapshot(
            tuple(
                DeviceInfo(r.device_id, r.num_train_samples, r.online)
                for r in self.records()
                if r.hello is not None
            )
        )
