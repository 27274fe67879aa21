"""What the dashboard costs per change as the fleet grows: its bytes and the time to make them.

For 100, 1,000 and 10,000 devices with a full history (1,000 rounds, every device evaluated):
the retained run history's size on the wire and the time to encode it (the coordinator pays it
after every round), the board taking in the fleet status and history as frames on their topics
(decoded and checked by the views' rule, as `serve` hands them over), the snapshot a page
receives first, whole (up to 10,000 devices; made and JSON-encoded once per change; later
updates are deltas, see `dashboard_scale`), and what each further request for it costs (the
text is cached per change). Median of `--repeats` runs. Writes docs/benchmarks.md.

    OMP_NUM_THREADS=1 python -m benchmarks.dashboard_cost [--devices 100,1000,10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from benchmarks.common import markdown_table, write_section
from coordinator.dashboard.board import Board
from coordinator.dashboard.history import RunHistoryLog
from coordinator.engine.round_types import RoundRecord
from coordinator.ops.status_pages import retained_pages
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import (
    RUN_HISTORY_ROUNDS,
    DeviceStatus,
    EvaluationReport,
    FleetDevice,
    FleetStatus,
)

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- dashboard-cost -->"
RUN_ID: Final = "cd" * 16


def fleet_of(devices: int) -> tuple[RunHistoryLog, FleetStatus, list[DeviceStatus]]:
    """A history of RUN_HISTORY_ROUNDS rounds, every device evaluated, and their statuses."""
    history = RunHistoryLog("default", {"task": "digits", "rounds": RUN_HISTORY_ROUNDS})
    for round_id in range(1, RUN_HISTORY_ROUNDS + 1):
        history.add_round(
            RoundRecord(round_id, devices, devices, 0.5, 10**6, 10**6, 0.2, {"norm": 1.0})
        )
    names = [f"dev-{i:05d}" for i in range(devices)]
    history.add_evaluations(
        EvaluationReport(
            run_id=RUN_ID, round_id=1, device_id=name, metric_name="accuracy",
            personalized=0.8, global_model=0.6, num_test_samples=20, num_train_samples=100,
        )
        for name in names
    )  # fmt: skip
    fleet = FleetStatus(
        fleet="default",
        round_id=RUN_HISTORY_ROUNDS,
        devices=tuple(
            FleetDevice(device_id=n, online=True, last_seen=1.0, rounds_taken=9) for n in names
        ),
    )
    return history, fleet, [DeviceStatus(device_id=n, state="online") for n in names]


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    """The median wall time of `action`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(devices: int, repeats: int) -> dict[str, float]:
    """Bytes and seconds of the history, the board's intake and one pushed snapshot."""
    history, fleet, statuses = fleet_of(devices)
    frame, pages = encode_frame(history.message(RUN_ID)), retained_pages(fleet)
    board = Board("benchmark")
    for status in statuses:
        board.offer(topics.device("default", status.device_id, "status"), encode_frame(status))

    def take_in() -> None:
        board.offer(topics.run_history("default"), frame)
        for topic, payload in pages:  # the fleet status as retained: a summary and its rows
            board.offer(topic, payload)

    take_in()
    snapshot = json.dumps(board.snapshot())
    return {
        "history_bytes": len(frame),
        "history_encode_s": median_seconds(lambda: encode_frame(history.message(RUN_ID)), repeats),
        "intake_s": median_seconds(take_in, repeats),
        "snapshot_bytes": len(snapshot),
        "snapshot_s": median_seconds(lambda: json.dumps(board.snapshot()), repeats),
        "cached_s": median_seconds(board.snapshot_json, repeats),
    }


def fleet_sizes(description: str, count: str, default: int) -> tuple[list[int], int]:
    """A dashboard benchmark's arguments: the fleet sizes (`--devices`) and `--<count>`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", default="100,1000,10000")
    parser.add_argument(f"--{count}", type=int, default=default)
    args = parser.parse_args()
    return [int(d) for d in args.devices.split(",")], int(getattr(args, count))


def write_table(
    marker: str, title: str, intro: list[str], header: list[str], rows: list[list[str]]
) -> None:
    """Write a benchmark's section of docs/benchmarks.md: its title, words and table."""
    lines = [marker, f"## {title}", "", *intro, "", *markdown_table(header, rows), marker]
    write_section(REPO / "docs/benchmarks.md", "\n".join(lines), marker)


def main() -> None:
    """Measure every fleet size and write the table."""
    sizes, repeats = fleet_sizes(__doc__.splitlines()[0], "repeats", 5)
    rows = []
    for devices in sizes:
        m = measure(devices, repeats)
        rows.append(
            [
                f"{devices:,}",
                f"{m['history_bytes'] / 2**10:,.0f} KiB",
                f"{m['history_encode_s'] * 1e3:,.0f} ms",
                f"{m['intake_s'] * 1e3:,.0f} ms",
                f"{m['snapshot_bytes'] / 2**10:,.0f} KiB",
                f"{m['snapshot_s'] * 1e3:,.0f} ms",
                f"{m['cached_s'] * 1e3:,.1f} ms",
            ]
        )
        print(rows[-1], flush=True)
    header = [
        "devices",
        "run history on the wire",
        "encode it (per round)",
        "board decodes, checks, takes history + fleet in",
        "the first snapshot",
        "make and encode it (a page's first snapshot)",
        "each further open page",
    ]
    intro = [
        f"With a full history ({RUN_HISTORY_ROUNDS:,} rounds) and every device evaluated; the "
        "coordinator encodes the retained history after every round, each open page receives the",
        "snapshot whole once (up to 10,000 devices), then deltas at most twice a second (see "
        "below); the board decodes and checks "
        "what `serve` hands it on a thread of its own. Median of "
        f"{repeats} runs, one process "
        "(`OMP_NUM_THREADS=1 python -m benchmarks.dashboard_cost`).",
    ]
    write_table(MARKER, "Dashboard cost as the fleet grows", intro, header, rows)


if __name__ == "__main__":
    main()
