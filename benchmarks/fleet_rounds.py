"""Round wall time over real brokers against the in-process hub, and bytes per update.

The same workload (digits with a ~1M-parameter MLP, 10 devices, 1 local epoch) runs through the
real coordinator and agents three ways: the in-process hub, loopback mosquitto, and the embedded
amqtt broker. Agents over MQTT are real MQTT clients (threads of this process, each with its own
model), so the difference is broker and wire overhead.

    python -m benchmarks.fleet_rounds [--rounds 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_section
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols.transport.broker import free_port

MARKER = "<!-- fleet-rounds -->"
HIDDEN = 13_500  # 64 * h + h + h * 10 + 10 parameters: about 1.0M


def _mosquitto(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    port = free_port()
    config = directory / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nuser root\n")
    process = subprocess.Popen([binary, "-c", str(config)], stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return process, f"mqtt://127.0.0.1:{port}"


def measure(transport: str, broker: str | None, rounds: int) -> dict[str, float]:
    """Median training-round seconds and bytes per update for one transport."""
    settings = SimulationSettings.load(
        None,
        workers=1,
        task="digits",
        task_options={"hidden": HIDDEN},
        algorithm="fedavg",
        devices=10,
        rounds=rounds,
        local_epochs=1,
        seed=0,
        transport=transport,
        broker=broker,
    )
    result = run_simulation(settings)
    # the last record also holds the final evaluation: time only the training rounds before it
    round_times = [record.wall_seconds for record in result.records[:-1]] or [
        result.records[-1].wall_seconds
    ]
    per_update = statistics.median(
        r.bytes_up / r.participants for r in result.records[:-1] or result.records
    )
    parameters = sum(t.numel() for t in result.final_shared.values())
    return {
        "round_seconds": statistics.median(round_times),
        "bytes_per_update": per_update,
        "raw_bytes": 4 * parameters,
        "parameters": parameters,
    }


def main() -> None:
    """Measure the three transports and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    rows = {}
    rows["in-process hub"] = measure("inprocess", None, args.rounds)
    with tempfile.TemporaryDirectory() as directory:
        process, url = _mosquitto(Path(directory))
        try:
            rows["mosquitto (loopback)"] = measure("mqtt", url, args.rounds)
        finally:
            process.terminate()
            process.wait()
    rows["embedded amqtt"] = measure("mqtt", None, args.rounds)
    base = rows["in-process hub"]["round_seconds"]
    lines = [
        MARKER,
        "## Fleet rounds over real brokers",
        "",
        f"digits with a 64-{HIDDEN}-10 MLP ({int(rows['in-process hub']['parameters']):,} "
        f"parameters, {rows['in-process hub']['raw_bytes'] / 2**20:.1f} MiB of float32), 10 "
        f"devices, FedAvg, 1 local epoch; median of {args.rounds - 1} training rounds.",
        "",
        "| transport | round (s) | vs in-process | bytes per update | vs raw shared size |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['round_seconds']:.2f} | {row['round_seconds'] / base:.2f}x | "
            f"{row['bytes_per_update']:,.0f} | {row['bytes_per_update'] / row['raw_bytes']:.3f}x |"
        )
    lines += ["", "Command: `python -m benchmarks.fleet_rounds`.", MARKER]
    section = "\n".join(lines)
    write_section(args.out, section, MARKER)
    print(section)


if __name__ == "__main__":
    main()
