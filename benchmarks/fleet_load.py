"""Load: 100 agents against one coordinator over loopback mosquitto for 20 rounds.

The coordinator runs as its own process (`pfl-coord serve`), so its peak memory is its own; the
100 agents are real MQTT clients in this process (threads, each with its own model and data).
Reports rounds completed, updates lost (selected but not aggregated; must be 0), p50/p95 round
time and the coordinator's peak RSS.

    python -m benchmarks.fleet_load [--agents 100] [--rounds 20] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import one_thread, publish_section
from device_agent.agent import DeviceAgent, device_will
from device_agent.state_store import MemoryStateStore
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols.transport.broker import free_port
from protocols.transport.factory import connect

MARKER = "<!-- fleet-load -->"


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    """Run the load and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    one_thread()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        port = free_port()
        (root / "mosquitto.conf").write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\nuser root\n"
            "max_queued_messages 10000\n"
        )
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        broker = subprocess.Popen(
            [binary, "-c", str(root / "mosquitto.conf")], stderr=subprocess.DEVNULL
        )
        url = f"mqtt://127.0.0.1:{port}"
        time.sleep(0.5)
        serve = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli.app", "serve", "--broker", url,
             "--task", "digits", "--algorithm", "fedavg", "--rounds", str(args.rounds),
             "--min-devices", str(args.agents),
             "--round-timeout", "120", "--out", str(root / "run"),
             "--checkpoint-dir", str(root / "checkpoint")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        task = load_task("digits")
        fleet = task.make_fleet(args.agents, PartitionSpec(), 0)
        agents = []
        for index, data in enumerate(fleet):
            device_id = f"dev-{index:04d}"
            workspace = task.build_model(0)
            will = device_will("default", device_id)
            transport = connect(url, device_id, will, clean_start=True)
            agent = DeviceAgent(
                device_id=device_id, fleet="default", transport=transport,
                task=task, data=data, seed=0, store=MemoryStateStore(), workspace=workspace,
                initial_state={k: v.clone() for k, v in workspace.state_dict().items()},
            )  # fmt: skip
            agent.start()
            agents.append(agent)
        peak = 0
        watched = psutil.Process(serve.pid)
        while serve.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        for agent in agents:
            agent.transport.close()
        broker.terminate()
        broker.wait()
        lines = [
            json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines() if x
        ]
    times = [line["wall_seconds"] for line in lines]
    lost = sum(line["selected"] - line["participants"] for line in lines)
    publish_section(
        args.out,
        MARKER,
        [
            "## Load: 100 agents over loopback mosquitto",
            "",
            f"{args.agents} agents (MQTT clients in one process, a digits MLP each) against "
            f"`pfl-coord serve` in its own process, FedAvg, {args.rounds} rounds, full "
            "participation.",
            "",
            "| rounds completed | updates lost | p50 round (s) | p95 round (s) "
            "| coordinator peak RSS (MiB) |",
            "|---:|---:|---:|---:|---:|",
            f"| {len(lines)} of {args.rounds} | {lost} | {statistics.median(times):.2f} | "
            f"{_percentile(times, 0.95):.2f} | {peak / 2**20:.0f} |",
            "",
            "Command: `python -m benchmarks.fleet_load`.",
        ],
    )


if __name__ == "__main__":
    main()
