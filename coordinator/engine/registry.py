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
        self._changed: set[str] = set()  # ids whose record or usage changed since last drained
        self._broadcast = 0  # bytes broadcast to every online device so far
        self._marks: dict[str, int] = {}  # online id -> `_broadcast` its bytes_down counts up to
        self._missed: tuple[int, int] = (-1, 0)  # the last round with stragglers, how many
        self._snapshot: FleetSnapshot | None = None  # the planning view; None: a change since
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
                    usage = self._used(device_id)
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
            missed = 0
            for device_id in device_ids:
                usage = self._used(device_id)
                usage.missed_deadlines += 1
                usage.missed_round = round_id
                missed += 1
            self._missed = (round_id, missed)

    def count_up(self, device_id: str, size: int) -> None:
        """`size` payload bytes arrived from `device_id` (counted only for a known device)."""
        with self._lock:
            if device_id in self._devices:
                self._used(device_id).bytes_up += size

    def count_down(self, sizes: Mapping[str, int]) -> int:
        """Payload bytes sent for each device (its downloads; known devices): their total."""
        with self._lock:
            for device_id, size in sizes.items():
                if device_id in self._devices:
                    self._used(device_id).bytes_down += size
        return sum(sizes.values())

    def count_broadcast(self, size: int) -> int:
        """A broadcast of `size` bytes, which each device online now receives: their total.

        O(1): one fleet-wide counter; each online device's share is settled when it goes
        offline or is read (`usage`, `row_usage`), not written into every device per broadcast.
        """
        with self._lock:
            self._broadcast += size
            return size * len(self._online)

    def _used(self, device_id: str) -> DeviceUsage:
        """The device's usage to change (under the lock): its row changes with it."""
        self._changed.add(device_id)
        return self._usage.setdefault(device_id, DeviceUsage())

    def usage(self) -> dict[str, DeviceUsage]:
        """Each device's bytes and round time so far (copies), broadcasts to it included."""
        with self._lock:
            used = {d: replace(u) for d, u in self._usage.items()}
            for device_id, mark in self._marks.items():
                if self._broadcast > mark:
                    use = used.setdefault(device_id, DeviceUsage())
                    use.bytes_down += self._broadcast - mark
            return used

    def row_usage(self, device_id: str) -> tuple[DeviceUsage, int | None]:
        """One device's usage with broadcasts up to a mark, and the mark (None: offline).

        Its full `bytes_down` is that plus `broadcast_bytes() - mark`: a row published with the
        mark stays true for an online device while only broadcasts reach it.
        """
        with self._lock:
            use = replace(self._usage.get(device_id) or DeviceUsage())
            return use, self._marks.get(device_id)

    def broadcast_bytes(self) -> int:
        """Bytes broadcast to every online device so far."""
        return self._broadcast

    def drain_changed(self) -> set[str]:
        """Ids whose record or usage changed since the last call (a round's rows to refresh)."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return changed

    def stragglers(self, round_id: int) -> int:
        """How many devices let round `round_id`'s deadline pass while connected."""
        last, count = self._missed
        return count if last == round_id else 0

    def count(self) -> int:
        """How many devices are known (said hello, or restored from a checkpoint)."""
        return len(self._devices)

    def has(self, device_id: str) -> bool:
        """Whether the device has a record (said hello, or restored from a checkpoint)."""
        return device_id in self._devices

    def record(self, device_id: str) -> DeviceRecord | None:
        """One device's record (None: unknown)."""
        with self._lock:
            return self._devices.get(device_id)

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
        """Keep `record` (under the lock), the online set and the broadcast marks with it."""
        device_id = record.device_id
        previous = self._devices.get(device_id)
        self._devices[device_id] = record
        self._changed.add(device_id)
        if previous is None or _planned(previous) != _planned(record):
            self._snapshot = None
        if record.online != (device_id in self._online):
            if record.online:
                self._online.add(device_id)
                self._marks[device_id] = self._broadcast
            else:
                self._online.discard(device_id)
                share = self._broadcast - self._marks.pop(device_id, self._broadcast)
                if share:
                    self._usage.setdefault(device_id, DeviceUsage()).bytes_down += share
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
        """The planning view of the fleet, rebuilt only after a change to what planning reads.

        A round's updates change records (round, loss, last seen) but not this: a round in a
        steady fleet plans from the same snapshot instead of copying the fleet again.
        """
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None:
            with self._lock:
                records = [self._devices[key] for key in sorted(self._devices)]
                snapshot = FleetSnapshot(
                    tuple(
                        DeviceInfo(r.device_id, r.num_train_samples, r.online)
                        for r in records
                        if r.hello is not None
                    )
                )
                self._snapshot = snapshot
        return snapshot


def _planned(record: DeviceRecord) -> tuple[int, bool, bool]:
    """What of a record the planning view reads."""
    return record.num_train_samples, record.online, record.hello is not None
