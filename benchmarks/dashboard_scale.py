"""The dashboard's page at scale: bytes per update and render time in a real headless Chromium.

For 100, 1,000 and 10,000 devices (a full history of 1,000 rounds, every device evaluated, as
`dashboard_cost` builds it, with seeded values that differ per device), a real server and page:
the first snapshot (as JSON, and gzipped as a browser that accepts gzip gets it), then updates
where 1% of the devices change (online state, last seen) and a round ends. Per update, the
bytes on the wire (a delta on the gzip event stream) against what a whole snapshot per push
would be; the page's main-thread time (parse, apply, render, style and layout: `lastUpdateMs`)
for the first snapshot and the median update; the elements the page holds (only the fleet rows
in view are drawn). Writes docs/benchmarks.md.

    OMP_NUM_THREADS=1 nice python -m benchmarks.dashboard_scale [--devices 100,1000,10000]
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
from typing import Any, Final

from benchmarks.dashboard_cost import RUN_ID, fleet_of, fleet_sizes, write_table
from coordinator.dashboard.board import Board
from coordinator.dashboard.history import RunHistoryLog
from coordinator.dashboard.server import DashboardServer, Listen
from coordinator.dashboard.stream import EventEncoder, snapshot_delta
from coordinator.engine.round_types import RoundRecord
from protocols.messages import RUN_HISTORY_ROUNDS, FleetStatus
from tests.e2e.browser import chromium_page

MARKER: Final = "<!-- dashboard-scale -->"
CHANGED_SHARE: Final = 0.01
WAIT_MS: Final = 120_000


def varied_fleet(devices: int) -> tuple[RunHistoryLog, FleetStatus]:
    """`dashboard_cost.fleet_of`'s history and fleet with seeded, differing values per device.

    (Identical rows would compress far better than a real fleet's.)
    """
    history, fleet, _ = fleet_of(devices)
    draw = random.Random(0)
    history.devices = {
        name: result.model_copy(
            update={
                "personalized": draw.random(),
                "global_model": draw.random(),
                "num_train_samples": draw.randint(20, 2000),
            }
        )
        for name, result in history.devices.items()
    }
    rows = tuple(
        d.model_copy(
            update={
                "last_seen": 1.7e9 + draw.random() * 1e4,
                "rounds_taken": draw.randint(0, 1000),
                "round_id": draw.randint(900, 1000),
                "last_loss": draw.random(),
                "num_train_samples": draw.randint(20, 2000),
                "declines": draw.choice((0, 0, 0, 1, 7)),
            }
        )
        for d in fleet.devices
    )
    return history, fleet.model_copy(update={"devices": rows})


def _changed_fleet(fleet: FleetStatus, step: int) -> FleetStatus:
    """`fleet` with 1% of its devices (a different 1% each step) flipped online/offline."""
    every = round(1 / CHANGED_SHARE)
    devices = tuple(
        d.model_copy(update={"online": not d.online, "last_seen": d.last_seen + step})
        if i % every == step % every
        else d
        for i, d in enumerate(fleet.devices)
    )
    return FleetStatus(fleet=fleet.fleet, round_id=fleet.round_id + step, devices=devices)


def measure(devices: int, updates: int) -> dict[str, Any]:
    """Bytes and page time of the first snapshot and of `updates` updates."""
    history, fleet = varied_fleet(devices)
    board = Board("benchmark", "default")
    board.apply(fleet)
    board.apply(history.message(RUN_ID))
    _, first = board.state()
    first_json = json.dumps(first).encode()
    wire = EventEncoder(gzip=True)
    wire.event("snapshot", first, 0.0)
    first_wire = wire.sent
    result: dict[str, Any] = {
        "snapshot_bytes": len(first_json),
        "snapshot_gzip": len(gzip.compress(first_json, 6)),
        "first_wire": first_wire,
    }
    with (
        DashboardServer(board, Listen("127.0.0.1", 0), open_to_local_users=True) as server,
        chromium_page(width=1400, height=1000) as page,
    ):
        page.goto(server.url)
        page.wait_for_function("() => window.pflDashboard.updates > 0", timeout=WAIT_MS)
        result["first_ms"] = page.evaluate("window.pflDashboard.lastUpdateMs")
        result["elements"] = page.evaluate("document.getElementsByTagName('*').length")
        delta_bytes, whole_bytes, update_ms = [], [], []
        sent = first
        for step in range(1, updates + 1):
            updates = page.evaluate("window.pflDashboard.updates")
            history.add_round(
                RoundRecord(RUN_HISTORY_ROUNDS + step, devices, devices, 0.5, 10**6, 10**6, 0.2)
            )
            board.apply(_changed_fleet(fleet, step))
            board.apply(history.message(RUN_ID))
            _, now = board.state()
            before = wire.sent
            wire.event("delta", snapshot_delta(sent, now), 0.0)
            delta_bytes.append(wire.sent - before)
            whole_bytes.append(len(json.dumps(now)))
            sent = now
            page.wait_for_function(
                f"() => window.pflDashboard.updates > {updates} && "
                f"Number(document.body.dataset.version) >= {board.version}",
                timeout=WAIT_MS,
            )
            update_ms.append(page.evaluate("window.pflDashboard.lastUpdateMs"))
        result["delta_wire"] = statistics.median(delta_bytes)
        result["whole_bytes"] = statistics.median(whole_bytes)
        result["update_ms"] = statistics.median(update_ms)
    return result


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def main() -> None:
    """Measure every fleet size and write the table."""
    sizes, updates = fleet_sizes(__doc__.splitlines()[0], "updates", 5)
    rows = []
    for devices in sizes:
        m = measure(devices, updates)
        rows.append(
            [
                f"{devices:,}",
                _size(m["snapshot_bytes"]),
                _size(m["snapshot_gzip"]),
                f"{m['first_ms']:,.0f} ms",
                _size(m["whole_bytes"]),
                _size(m["delta_wire"]),
                f"{m['update_ms']:,.0f} ms",
                f"{m['elements']:,}",
            ]
        )
        print(rows[-1], flush=True)
    header = [
        "devices",
        "first snapshot (JSON)",
        "gzipped",
        "page: first render",
        "an update as a whole snapshot",
        "an update on the wire (gzip delta)",
        "page: one update",
        "page elements",
    ]
    intro = [
        f"A full history ({RUN_HISTORY_ROUNDS:,} rounds), every device evaluated, values drawn "
        "per device (seeded); each update "
        f"changes {CHANGED_SHARE:.0%} of the devices (online state, last seen) and adds a round.",
        "The page gets the first snapshot whole, then deltas (rows added, changed or gone) on one "
        "gzip stream; it draws only the fleet rows in view. Page times are its main thread "
        "(parse, apply, render, style, layout) in headless Chromium (Debian's, via Playwright); "
        "the first render is one measurement and includes the page's start-up (its charts "
        f"made); the update figures are the median of {updates} updates "
        "(`OMP_NUM_THREADS=1 nice python -m benchmarks.dashboard_scale`, on a shared 2-core "
        "machine).",
    ]
    title = "Dashboard at scale: bytes per update and render time in Chromium"
    write_table(MARKER, title, intro, header, rows)


if __name__ == "__main__":
    main()
