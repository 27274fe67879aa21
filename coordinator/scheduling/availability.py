"""Simulated devices' speed and availability, on a simulated clock.

Real fleets are neither equally fast nor always online. A simulation can give every device a
compute speed (log-normal: most near the median, a few much slower) and on/off sessions (a daily
pattern, random dropouts, or a CSV trace of real sessions), so that time-to-accuracy is measured
in simulated seconds, independent of the machine that runs the simulation.

Everything here is pure: sessions and speeds follow from the seed and the device's id.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

Interval = tuple[float, float]
AvailabilityKind = Literal["always", "diurnal", "trace"]
_Z95: float = 1.6448536269514722
"""The standard normal's 95th percentile: a log-normal's 5th-95th ratio is exp(2 z95 sigma)."""


@dataclass(frozen=True)
class DeviceTiming:
    """How long a device takes for a job: a fixed latency plus its samples over its speed."""

    seconds_per_sample: float = 0.01
    """Seconds one epoch over one sample takes at speed 1."""
    latency_s: float = 1.0
    """Per job: downloading the model, starting up, sending the update."""

    def duration_s(self, samples: int, epochs: int, speed: float) -> float:
        """Simulated seconds one training job takes on a device of `speed`."""
        return self.latency_s + samples * epochs * self.seconds_per_sample / speed


def parse_speeds(text: str) -> float:
    """`equal` (ratio 1) or `lognormal:<ratio>`: the spread between fast and slow devices.

    Raises:
        ValueError: another form, or a ratio below 1.
    """
    if text == "equal":
        return 1.0
    name, _, number = text.partition(":")
    try:
        ratio = float(number) if name == "lognormal" else math.nan
    except ValueError:
        ratio = math.nan
    if not ratio >= 1.0 or not math.isfinite(ratio):
        msg = f"speeds {text!r}: use equal or lognormal:<ratio of the 95th to the 5th percentile>"
        raise ValueError(msg)
    return ratio


def lognormal_speeds(count: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Speeds with median 1 whose 95th percentile is `ratio` times the 5th (1: all equal)."""
    if ratio <= 1.0:
        return np.ones(count)
    sigma = math.log(ratio) / (2 * _Z95)
    return np.exp(rng.normal(0.0, sigma, size=count))


def fastest_first(speeds: dict[str, float], fastest: frozenset[str]) -> dict[str, float]:
    """The same speeds handed out again so the devices in `fastest` hold the top ones.

    Simulation gives its liars the fleet's top speeds this way (`--attack-speed fastest`): a
    device that answers first lands in the most asynchronous buffers. The others keep their
    order; the multiset of speeds is unchanged.
    """
    ranked = sorted(speeds.values(), reverse=True)
    chosen = sorted(d for d in speeds if d in fastest)
    others = sorted((d for d in speeds if d not in fastest), key=lambda d: (-speeds[d], d))
    return dict(zip([*chosen, *others], ranked, strict=True))


@dataclass(frozen=True)
class AvailabilitySpec:
    """Which sessions devices are online in.

    `diurnal`: each device is online `on_fraction` of every `period_s`, starting at a random
    phase of its own. `trace`: the sessions of a CSV (device,start_s,end_s), repeated every
    `period_s` (default: the trace's last end). Any of them may add random dropouts: online
    stretches of mean `uptime_s` (exponential), each followed by `downtime_s` offline.
    """

    kind: AvailabilityKind = "always"
    on_fraction: float = 0.5
    period_s: float = 86_400.0
    trace: dict[str, tuple[Interval, ...]] = field(default_factory=dict)
    uptime_s: float = 0.0
    downtime_s: float = 300.0

    @classmethod
    def parse(cls, text: str, uptime_s: float = 0.0, downtime_s: float = 300.0) -> AvailabilitySpec:
        """`always`, `diurnal[:on_fraction[:period_s]]` or `trace:<file.csv>`.

        Raises:
            ValueError: another form or out-of-range numbers; a trace that does not parse.
            FileNotFoundError: the trace file is missing.
        """
        name, _, rest = text.partition(":")
        if uptime_s < 0 or downtime_s < 0:
            msg = "uptime and downtime must not be negative"
            raise ValueError(msg)
        dropouts = cls(uptime_s=uptime_s, downtime_s=downtime_s)
        if name == "always" and not rest:
            return dropouts
        if name == "trace" and rest:
            sessions = load_trace(Path(rest))
            period = max(end for intervals in sessions.values() for _, end in intervals)
            return replace(dropouts, kind="trace", period_s=period, trace=sessions)
        if name == "diurnal":
            parts = rest.split(":") if rest else []
            try:
                values = [float(p) for p in parts]
            except ValueError:
                values = [math.nan]
            fraction = values[0] if values else 0.5
            period = values[1] if len(values) > 1 else 86_400.0
            if len(values) <= 2 and 0 < fraction <= 1 and period > 0 and math.isfinite(period):
                return replace(dropouts, kind="diurnal", on_fraction=fraction, period_s=period)
        msg = (
            f"availability {text!r}: use always, diurnal[:on_fraction[:period_s]] "
            "(fraction in (0, 1]) or trace:<file.csv>"
        )
        raise ValueError(msg)


def load_trace(path: Path) -> dict[str, tuple[Interval, ...]]:
    """Sessions per device from a CSV with the columns device, start_s, end_s.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a missing column, a row that is not numbers, or end before start.
    """
    sessions: dict[str, list[Interval]] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"device", "start_s", "end_s"} - set(reader.fieldnames or ())
        if missing:
            msg = (
                f"{path}: the trace needs the columns device, start_s, end_s (no {sorted(missing)})"
            )
            raise ValueError(msg)
        for line, row in enumerate(reader, start=2):
            try:
                start, end = float(row["start_s"]), float(row["end_s"])
            except (TypeError, ValueError):
                msg = f"{path}:{line}: start_s and end_s must be numbers"
                raise ValueError(msg) from None
            if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
                msg = f"{path}:{line}: a session needs 0 <= start_s < end_s"
                raise ValueError(msg)
            sessions.setdefault(row["device"].strip(), []).append((start, end))
    if not sessions:
        msg = f"{path}: the trace has no sessions"
        raise ValueError(msg)
    return {device: tuple(merge_intervals(spans)) for device, spans in sessions.items()}


def merge_intervals(spans: list[Interval]) -> list[Interval]:
    """Sorted, overlapping or touching sessions joined into one."""
    merged: list[Interval] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class DeviceSessions:
    """One device's online sessions, made lazily as the simulated clock moves on."""

    def __init__(self, spec: AvailabilitySpec, device_id: str, rng: np.random.Generator) -> None:
        self._spec = spec
        self._rng = rng
        self._base = spec.trace.get(device_id, ()) if spec.kind == "trace" else ()
        self._phase = float(rng.uniform(0.0, spec.period_s)) if spec.kind == "diurnal" else 0.0
        self._periods = 0
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._back_at = -math.inf
        """No session starts before this: the end of the last dropout."""
        self._next_drop: float | None = None

    def online(self, t: float) -> bool:
        """Whether the device is online at simulated time `t`."""
        return self.session_end(t) is not None

    def session_end(self, t: float) -> float | None:
        """When the session holding `t` ends (None: offline at `t`)."""
        if self._spec.kind == "always" and not self._spec.uptime_s:
            return math.inf
        self._extend(t)
        index = bisect.bisect_right(self._starts, t) - 1
        if index >= 0 and t < self._ends[index]:
            return self._ends[index]
        return None

    def next_start(self, t: float) -> float | None:
        """The first time at or after `t` the device is online (None: never again)."""
        if self.online(t):
            return t
        if self._spec.kind == "trace" and not self._base:
            return None
        for _ in range(4):  # a period always holds a session unless the device has none
            self._extend(t + self._spec.period_s)
            index = bisect.bisect_right(self._starts, t)
            if index < len(self._starts):
                return self._starts[index]
            t += self._spec.period_s
        return None

    def _extend(self, t: float) -> None:
        """Make sessions until they cover time `t`."""
        spec = self._spec
        period = spec.period_s if spec.kind != "always" else max(spec.uptime_s, 1.0) * 64
        while self._periods * period <= t + period:
            offset = self._periods * period
            for start, end in self._period_sessions(offset, period):
                self._add(start, end)
            self._periods += 1

    def _period_sessions(self, offset: float, period: float) -> list[Interval]:
        spec = self._spec
        if spec.kind == "always":
            spans = [(offset, offset + period)]
        elif spec.kind == "diurnal":
            start = offset + self._phase
            length = spec.on_fraction * period
            spans = [(start - period, start - period + length)] if offset == 0 else []
            spans.append((start, start + length))
        else:
            spans = [(offset + a, offset + b) for a, b in self._base]
        return spans

    def _add(self, start: float, end: float) -> None:
        """Add a session, cut by the random dropouts when the spec has them.

        Dropouts are one process across sessions: the next one is an exponential uptime after
        the device was last back, whichever session it falls in.
        """
        t = max(start, self._back_at)
        while t < end:
            if self._spec.uptime_s and self._next_drop is None:
                self._next_drop = t + float(self._rng.exponential(self._spec.uptime_s))
            stop = end if self._next_drop is None else min(end, self._next_drop)
            if self._ends and self._ends[-1] == t:  # the session goes on across a period
                self._ends[-1] = stop
            else:
                self._starts.append(t)
                self._ends.append(stop)
            if self._next_drop is not None and self._next_drop < end:
                t = self._back_at = self._next_drop + self._spec.downtime_s
                self._next_drop = None
            else:
                t = end


class SimulatedClock:
    """The simulated time, and every device's speed and sessions.

    Devices are addressed by id; their randomness is drawn from the run seed and their position
    in the sorted id list, so it does not depend on which worker simulates them.
    """

    def __init__(
        self,
        device_ids: list[str],
        seed: int,
        *,
        speed_ratio: float = 1.0,
        availability: AvailabilitySpec | None = None,
        timing: DeviceTiming | None = None,
        deadline_s: float = 0.0,
        fastest: frozenset[str] = frozenset(),
    ) -> None:
        ordered = sorted(device_ids)
        speeds = lognormal_speeds(len(ordered), speed_ratio, np.random.default_rng([seed, 71]))
        self.speeds = fastest_first(
            dict(zip(ordered, (float(s) for s in speeds), strict=True)), fastest
        )
        spec = availability or AvailabilitySpec()
        self.sessions = {
            device: DeviceSessions(spec, device, np.random.default_rng([seed, 72, index]))
            for index, device in enumerate(ordered)
        }
        self.timing = timing or DeviceTiming()
        self.deadline_s = deadline_s
        """A synchronous round's deadline in simulated seconds (0: none)."""
        self.now = 0.0

    def online(self, device_id: str) -> bool:
        """Whether the device is online now (unknown ids never are)."""
        sessions = self.sessions.get(device_id)
        return sessions is not None and sessions.online(self.now)

    def job(self, device_id: str, samples: int, epochs: int) -> tuple[float, bool]:
        """A job started now: (when it ends, whether the device stays online until then).

        A device that goes offline first ends the job at that moment, without an update.
        """
        finish = self.now + self.timing.duration_s(samples, epochs, self.speeds[device_id])
        end = self.sessions[device_id].session_end(self.now)
        if end is None:
            return self.now, False
        return (finish, True) if finish <= end else (end, False)

    def next_online(self, device_ids: list[str]) -> float | None:
        """The earliest time from now that one of `device_ids` is online (None: never)."""
        starts = [self.sessions[d].next_start(self.now) for d in device_ids if d in self.sessions]
        known = [s for s in starts if s is not None]
        return min(known) if known else None
