"""Round time and bytes per link profile: a fleet whose every device is behind a shaped link.

Each device of one `pfl-agent pool` process (a real MQTT client each) reaches mosquitto through
the fault proxy of `tests/netlab` shaped as one link profile (every connection shaped on its
own); `serve` (in this process) talks to mosquitto directly, as a coordinator in a data centre
would. digits, FedAvg, full participation, per profile and model size: the median training
round, and the bytes each device's link carried per round (MQTT framing, chunk headers, status
and hello included, both directions) next to the payload bytes of one update.

    python -m benchmarks.link_profiles [--devices 4] [--rounds 3] [--profiles lte,...]
        [--hidden 0,1024] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import choose, markdown_table, one_thread, publish_section
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings
from tests.conftest import Mosquitto, free_port, mosquitto_binary
from tests.netlab.profiles import PROFILES, Link
from tests.netlab.proxy import FaultProxy

MARKER = "<!-- link-profiles -->"
_SLOW_UP_BPS = 10_000
"""Links slower than this upstream run only the default model (the wider one takes minutes)."""


@dataclass(frozen=True)
class Measured:
    """One profile and model size."""

    link: Link
    hidden: int
    parameters: int
    rounds_done: int
    round_s: float
    link_bytes_per_round: float
    update_bytes: float


def measure(link: Link, hidden: int, devices: int, rounds: int, directory: Path) -> Measured:
    """Serve `rounds` rounds to `devices` devices behind `link`, on a broker of its own.

    A fresh broker per measurement: one shared with an earlier run would hand the new devices
    that run's retained model too.
    """
    broker = Mosquitto(mosquitto_binary(), directory, free_port())
    broker.start()
    try:
        return _measure(broker, link, hidden, devices, rounds, directory)
    finally:
        broker.stop()


def _measure(
    broker: Mosquitto, link: Link, hidden: int, devices: int, rounds: int, directory: Path
) -> Measured:
    options: dict[str, Any] = {"hidden": hidden} if hidden else {}
    config = directory / "pool.toml"
    config.write_text(f"[task_options]\nhidden = {hidden}\n" if hidden else "")
    with FaultProxy(broker.port, link) as proxy:
        pool = subprocess.Popen(
            [sys.executable, "-m", "device_agent.cli", "pool", "--broker", proxy.url,
             "--devices", f"0-{devices - 1}", "--num-shards", str(devices), "--task", "digits",
             "--config", str(config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            settings = ServeSettings.load(
                None,
                broker=broker.url,
                task="digits",
                task_options=options,
                algorithm="fedavg",
                rounds=rounds,
                min_devices=devices,
                round_timeout=900.0,
                join_timeout=300.0,
                out=directory / "run",
                checkpoint_dir=directory / "checkpoint",
            )
            result = run_serve(settings)
        finally:
            pool.send_signal(signal.SIGTERM)
            pool.wait(timeout=60)
        carried = proxy.bytes_up + proxy.bytes_down
    records = result.records
    training = records[:-1] or records  # the last round also evaluates
    return Measured(
        link=link,
        hidden=hidden,
        parameters=sum(t.numel() for t in result.final_shared.values()),
        rounds_done=sum(1 for r in records if r.participants == devices),
        round_s=statistics.median(r.wall_seconds for r in training),
        link_bytes_per_round=carried / devices / len(records),
        update_bytes=statistics.median(r.bytes_up / r.participants for r in records),
    )


def _rows(results: list[Measured], rounds: int) -> list[list[str]]:
    rows = []
    for m in results:
        up = "-" if m.link.up_bps is None else f"{m.link.up_bps * 8 / 1000:,.0f}"
        down = "-" if m.link.down_bps is None else f"{m.link.down_bps * 8 / 1000:,.0f}"
        rows.append(
            [
                m.link.name,
                f"{up} / {down}",
                f"{m.link.latency_s * 1000:.0f} + 0-{m.link.jitter_s * 1000:.0f}",
                f"{m.parameters:,}",
                f"{m.rounds_done} of {rounds}",
                f"{m.round_s:.2f}",
                f"{m.update_bytes:,.0f}",
                f"{m.link_bytes_per_round:,.0f}",
            ]
        )
    return rows


def main() -> None:
    """Measure every profile and model size and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profiles", default=None, help=f"of {', '.join(PROFILES)}")
    parser.add_argument("--hidden", default="0,1024", help="digits hidden widths (0: default)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    one_thread()
    logging.disable(logging.WARNING)
    widths = [int(w) for w in args.hidden.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for name in choose(args.profiles, list(PROFILES), "profile"):
            link = PROFILES[name]
            for hidden in widths:
                if hidden and link.up_bps is not None and link.up_bps < _SLOW_UP_BPS:
                    continue
                run_dir = Path(directory) / f"{name}-{hidden}"
                run_dir.mkdir()
                results.append(measure(link, hidden, args.devices, args.rounds, run_dir))
                print(_rows(results[-1:], args.rounds)[0], flush=True)
    header = [
        "link",
        "up / down (kbit/s)",
        "one-way latency + jitter (ms)",
        "parameters",
        "rounds with every device",
        "median round (s)",
        "update payload (B)",
        "link bytes per device per round",
    ]
    publish_section(
        args.out,
        MARKER,
        [
            "## Rounds over shaped links",
            "",
            f"digits, FedAvg, {args.devices} devices (one `pfl-agent pool`, every device behind "
            f"its own shaped link through the fault proxy of tests/netlab; the coordinator on "
            f"loopback), {args.rounds} rounds, full participation. Stalls (lost packets) as in "
            "tests/netlab/profiles.py. Link bytes: both directions through the proxy, MQTT "
            "framing, chunk headers, hello and status included, averaged over the run. Links "
            "under 80 kbit/s up run only the default model (the wider one takes minutes a round).",
            "",
            *markdown_table(header, _rows(results, args.rounds)),
            "",
            f"Command: `python -m benchmarks.link_profiles --devices {args.devices} "
            f"--rounds {args.rounds} --hidden {args.hidden}`.",
        ],
    )


if __name__ == "__main__":
    main()
