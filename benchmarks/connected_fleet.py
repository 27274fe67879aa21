"""Thousands of connected devices: real MQTT clients, one mosquitto, one `pfl-coord serve`.

`--devices` device agents run in `--pools` `pfl-agent pool` processes (each device its own MQTT
client) against one mosquitto on loopback; `pfl-coord serve` runs rounds selecting
`--participation` of them. A monitor client counts distinct hellos to time the connection phase.
Reports: time until every device has said hello, p50/p95 round time, updates lost (selected but
not aggregated; must be 0), and the coordinator's, the broker's and the pools' RSS and CPU seconds
per connected device.

    nice python -m benchmarks.connected_fleet [--devices 2000] [--pools 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from benchmarks.common import publish_section
from benchmarks.fleet_load import _percentile
from protocols.transport.broker import free_port

MARKER = "<!-- connected-fleet -->"
TIMEOUT = 1800.0


def _raise_fd_limit() -> None:
    """In a child before exec: as many open files as the hard limit allows (one per client)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class HelloCounter:
    """Distinct devices that said hello, when the last of `expected` did, and all hellos.

    A device says hello again when its connection was dropped; the coordinator's retained status
    tells that it is up.
    """

    def __init__(self, port: int, expected: int) -> None:
        self.seen: set[str] = set()
        self.hellos = 0
        self.expected = expected
        self.all_in = threading.Event()
        self.coordinator_up = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-monitor")
        self.client.on_connect = lambda c, *_: c.subscribe(
            [("pfl/default/device/+/hello", 1), ("pfl/default/coordinator/status", 1)]
        )
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, _client: mqtt.Client, _data: object, message: mqtt.MQTTMessage) -> None:
        if message.topic.endswith("/coordinator/status"):
            self.coordinator_up.set()
            return
        self.hellos += 1
        self.seen.add(message.topic.split("/")[3])
        if len(self.seen) >= self.expected:
            self.all_in.set()

    def close(self) -> None:
        """Stop listening."""
        self.client.loop_stop()
        self.client.disconnect()


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _tree_rss(process: psutil.Process) -> int:
    return int(process.memory_info().rss)


def _pool(
    url: str, args: argparse.Namespace, first: int, last: int, root: Path
) -> subprocess.Popen[bytes]:
    """One `pfl-agent pool` process serving devices first..last; its errors go to a log."""
    with (root / f"pool-{first}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "device_agent.cli", "pool", "--broker", url,
             "--task", args.task, "--devices", f"{first}-{last}",
             "--num-shards", str(args.devices), "--threads", "1"],
            preexec_fn=_raise_fd_limit, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip


def run(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """Start broker, coordinator and pools; measure; stop them all."""
    port = free_port()
    (root / "mosquitto.conf").write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\nuser root\n"
        "max_connections -1\nmax_queued_messages 100000\n"
        f"log_dest file {root / 'mosquitto.log'}\nlog_type error\nlog_type warning\n"
        "log_type notice\n"
    )
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    children: list[subprocess.Popen[bytes]] = []
    quiet = subprocess.DEVNULL
    broker = subprocess.Popen(
        [binary, "-c", str(root / "mosquitto.conf")],
        preexec_fn=_raise_fd_limit,
        stdout=quiet,
        stderr=quiet,
    )
    children.append(broker)
    try:
        time.sleep(0.5)
        url = f"mqtt://127.0.0.1:{port}"
        counter = HelloCounter(port, args.devices)
        serve = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli.app", "serve", "--broker", url,
             "--task", args.task, "--algorithm", "fedavg", "--rounds", str(args.rounds),
             "--min-devices", str(args.devices), "--participation", str(args.participation),
             "--round-timeout", "600", "--out", str(root / "run"),
             "--checkpoint-dir", str(root / "checkpoint")],
            preexec_fn=_raise_fd_limit, stdout=quiet, stderr=(root / "serve.log").open("wb"),
        )  # fmt: skip
        children.append(serve)
        if not counter.coordinator_up.wait(120):
            msg = f"the coordinator did not start: {(root / 'serve.log').read_text()[-2000:]}"
            raise RuntimeError(msg)
        time.sleep(2.0)  # let it settle: the baseline is its cost with no device
        watched = {"coord": psutil.Process(serve.pid), "broker": psutil.Process(broker.pid)}
        base_cpu = {k: _cpu(p) for k, p in watched.items()}
        base_rss = {k: _tree_rss(p) for k, p in watched.items()}
        bounds = [round(i * args.devices / args.pools) for i in range(args.pools + 1)]
        started = time.monotonic()
        pools = [_pool(url, args, first, last - 1, root) for first, last in pairwise(bounds)]
        children.extend(pools)
        while not counter.all_in.wait(1.0):
            failed = [p for p in pools if p.poll() is not None]
            if failed or time.monotonic() - started > TIMEOUT:
                logs = "".join(p.read_text()[-2000:] for p in sorted(root.glob("pool-*.log")))
                msg = f"only {len(counter.seen)} of {args.devices} devices said hello: {logs}"
                raise RuntimeError(msg)
        connect_seconds = time.monotonic() - started
        connected_cpu = {k: _cpu(p) for k, p in watched.items()}
        connected_rss = {k: _tree_rss(p) for k, p in watched.items()}
        peak = dict(connected_rss)
        while serve.poll() is None:
            try:
                for key, process in watched.items():
                    peak[key] = max(peak[key], _tree_rss(process))
                pool_rss = sum(_tree_rss(psutil.Process(p.pid)) for p in pools)
                end_cpu = {k: _cpu(p) for k, p in watched.items()}
            except psutil.NoSuchProcess:
                break
            time.sleep(0.5)
            if time.monotonic() - started > TIMEOUT * 2:
                msg = "the coordinator did not finish its rounds"
                raise RuntimeError(msg)
        counter.close()
        if not (root / "run" / "metrics.jsonl").exists():
            msg = f"the coordinator wrote no metrics: {(root / 'serve.log').read_text()[-2000:]}"
            raise RuntimeError(msg)
        lines = [
            json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines() if x
        ]
    finally:
        for child in reversed(children):
            child.terminate()
        deadline = time.monotonic() + 60  # one minute for all: pools of hundreds stop slowly
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    times = [line["wall_seconds"] for line in lines]
    log = (root / "mosquitto.log").read_text(errors="replace")
    rounds = max(1, len(lines))
    n = args.devices
    return {
        "round_times": ", ".join(f"{t:.1f}" for t in times),
        "rehellos": counter.hellos - len(counter.seen),
        "timeouts": log.count("exceeded timeout"),
        "coord_base_mib": base_rss["coord"] / 2**20,
        "broker_base_mib": base_rss["broker"] / 2**20,
        "rounds": len(lines),
        "selected": statistics.mean(line["selected"] for line in lines) if lines else 0,
        "lost": sum(line["selected"] - line["participants"] for line in lines),
        "connect_s": connect_seconds,
        "p50": statistics.median(times) if times else float("nan"),
        "p95": _percentile(times, 0.95) if times else float("nan"),
        "coord_peak_mib": peak["coord"] / 2**20,
        "broker_peak_mib": peak["broker"] / 2**20,
        "coord_kib_dev": (peak["coord"] - base_rss["coord"]) / n / 1024,
        "broker_kib_dev": (peak["broker"] - base_rss["broker"]) / n / 1024,
        "pool_kib_dev": pool_rss / n / 1024,
        "coord_connect_cpu": connected_cpu["coord"] - base_cpu["coord"],
        "broker_connect_cpu": connected_cpu["broker"] - base_cpu["broker"],
        "coord_ms_dev_round": (end_cpu["coord"] - connected_cpu["coord"]) / n / rounds * 1e3,
        "broker_ms_dev_round": (end_cpu["broker"] - connected_cpu["broker"]) / n / rounds * 1e3,
    }


def main() -> None:
    """Run the fleet and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--pools", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--participation", type=float, default=0.1)
    parser.add_argument("--task", default="synthetic")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the children on the way out
    with tempfile.TemporaryDirectory() as directory:
        r = run(args, Path(directory))
    command = "nice python -m benchmarks.connected_fleet"
    if (args.devices, args.pools, args.rounds, args.task) != (2000, 8, 5, "synthetic"):
        command += (
            f" --devices {args.devices} --pools {args.pools} --rounds {args.rounds}"
            f" --task {args.task}"
        )
    publish_section(
        args.out,
        MARKER,
        [
            f"## Connected fleet: {args.devices} MQTT clients on one machine",
            "",
            f"{args.devices} device agents ({args.task}, each its own MQTT client) in {args.pools} "
            f"`pfl-agent pool` processes, one mosquitto and `pfl-coord serve` on loopback, "
            f"FedAvg with `--participation {args.participation}` "
            f"({r['selected']:.0f} devices selected per round on average), all on one 2-core "
            "machine shared with other work. Connect: from starting the pools until every "
            "device's hello was seen. Per device: above the process's own cost with no device "
            "connected (RSS: peak over the run; CPU: seconds after everyone connected, over "
            "devices and rounds). Re-hellos: hellos after a device's first (each follows a "
            "dropped connection); keepalive drops: connections mosquitto closed because a "
            "client's keepalive ran out.",
            "",
            "| devices | connect + hello (s) | re-hellos | keepalive drops | rounds "
            "| updates lost | p50 round (s) | p95 round (s) | each round (s) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {args.devices} | {r['connect_s']:.1f} | {r['rehellos']} | {r['timeouts']} "
            f"| {r['rounds']} of {args.rounds} | {r['lost']} | {r['p50']:.2f} | {r['p95']:.2f} "
            f"| {r['round_times']} |",
            "",
            "| process | RSS with no device (MiB) | peak RSS (MiB) | RSS per device (KiB) "
            "| CPU to connect all (s) | CPU per device per round (ms) |",
            "|---|---:|---:|---:|---:|---:|",
            f"| coordinator | {r['coord_base_mib']:.0f} | {r['coord_peak_mib']:.0f} "
            f"| {r['coord_kib_dev']:.0f} | {r['coord_connect_cpu']:.1f} "
            f"| {r['coord_ms_dev_round']:.2f} |",
            f"| mosquitto | {r['broker_base_mib']:.0f} | {r['broker_peak_mib']:.0f} "
            f"| {r['broker_kib_dev']:.0f} | {r['broker_connect_cpu']:.1f} "
            f"| {r['broker_ms_dev_round']:.2f} |",
            f"| pools (sum, at the end) | | {r['pool_kib_dev'] * args.devices / 1024:.0f} "
            f"| {r['pool_kib_dev']:.0f} (all of it) | | |",
            "",
            f"Command: `{command}`.",
        ],
    )


if __name__ == "__main__":
    main()
