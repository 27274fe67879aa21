"""The aggregator tier over bridged mosquitto brokers, with real agent and aggregator processes.

`pfl-coord provision` writes a core broker and two site brokers bridged to it; each site's
devices connect to their site broker, each site's `pfl-coord aggregator` sums their updates
there, and the coordinator (on the core) combines the two partial aggregates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.engine.rounds import RoundRecord
from coordinator.ops.provision import ProvisionResult, provision
from coordinator.ops.site_brokers import Site
from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import device_name, run_simulation
from tests.conftest import free_port, mosquitto_binary, wait_for_port
from tests.e2e.conftest import Processes, run_child, serve_settings, sourced, wait_for

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]
RUN: dict[str, Any] = {"task": "digits", "algorithm": "fedavg", "seed": 0}
DEVICES = 4
SITES = {"a": (0, 1), "b": (2, 3)}


class _Brokers:
    """The core broker and the site brokers, from provision's own files."""

    def __init__(self, out: Path) -> None:
        self.core_port, self.ports = free_port(), {name: free_port() for name in SITES}
        sites = [
            Site(name, tuple(device_name(i) for i in indices), self.ports[name])
            for name, indices in SITES.items()
        ]
        self.result: ProvisionResult = provision(
            [], out, host="127.0.0.1", tls_port=self.core_port, sites=sites
        )
        self.processes: list[subprocess.Popen[bytes]] = []
        self._start(self.result.files["mosquitto.conf"], self.core_port)
        for name in SITES:
            self._start(self.result.sites[name].files["mosquitto.conf"], self.ports[name])

    def _start(self, config: Path, port: int) -> None:
        text = config.read_text()
        # As root, mosquitto would drop to its own user, who cannot read pytest's 0700 tmp dirs.
        text += "user root\n" if os.geteuid() == 0 else ""
        text += "persistence false\nlog_dest stderr\nlog_type all\n"
        test_config = config.with_name(f"mosquitto-test-{port}.conf")
        test_config.write_text(text)
        with config.with_name(f"mosquitto-{port}.log").open("ab") as log:
            process = subprocess.Popen(
                [mosquitto_binary(), "-c", str(test_config)], stdout=subprocess.DEVNULL, stderr=log
            )
        self.processes.append(process)
        if not wait_for_port(port):
            pytest.fail(f"mosquitto did not listen on {port}; see {log.name}")

    def core_options(self) -> dict[str, Any]:
        coordinator = self.result.coordinator
        return {
            "broker": self.result.broker_url,
            "username": coordinator.username,
            "password": coordinator.password,
            "ca_file": str(self.result.files["ca.crt"]),
        }

    def log(self, port: int) -> Path:
        """The log of the broker on `port`."""
        directory = self.result.directory
        return next(directory.rglob(f"mosquitto-{port}.log"))

    def bridged(self) -> bool:
        """Whether the core broker logged both site bridges' connections."""
        log = self.result.files["mosquitto.conf"].with_name(f"mosquitto-{self.core_port}.log")
        text = log.read_text(errors="replace") if log.exists() else ""
        return all(f" as pfl-bridge-{name} " in text for name in SITES)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            process.wait(timeout=10)


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[_Brokers]:
    started = _Brokers(tmp_path / "deploy")
    yield started
    started.stop()


def _aggregator(processes: Processes, brokers: _Brokers, name: str) -> None:
    config = brokers.result.sites[name].files["aggregator.toml"]
    command = [sys.executable, "-m", "coordinator.cli.app", "aggregator", "--config", str(config)]
    line = f"aggregator {name} serving"
    before = processes.log(f"aggregator-{name}").count(line)  # a restart appends to its log
    process = processes.start(f"aggregator-{name}", command)

    def serving() -> bool:
        log = processes.log(f"aggregator-{name}")
        if process.poll() is not None:
            pytest.fail(f"aggregator {name} exited: {log}")
        return log.count(line) > before

    wait_for(serving, f"aggregator {name} serving")


def _start_sites(processes: Processes, brokers: _Brokers) -> None:
    """Once both bridges are up: each site's aggregator, then every agent at its site."""
    wait_for(brokers.bridged, "both site bridges connected to the core")
    for name in SITES:
        _aggregator(processes, brokers, name)
    for index in range(DEVICES):
        device_id = device_name(index)
        env = sourced(brokers.result.directory / "devices" / f"{device_id}.env")
        command = [
            sys.executable, "-m", "device_agent.cli", "start", "--task", RUN["task"],
            "--data-shard", str(index), "--num-shards", str(DEVICES),
            "--state-dir", str(processes.directory / "state" / device_id),
        ]  # fmt: skip
        processes.start(device_id, command, env)


def _serve(
    brokers: _Brokers,
    tmp_path: Path,
    on_round: Callable[[RoundRecord], None] | None = None,
    **options: Any,
) -> ServeResult:
    """The run served on the core broker, with the tier's two aggregators."""
    settings = serve_settings(
        brokers.result.broker_url,
        tmp_path,
        **RUN,
        **brokers.core_options(),
        min_devices=DEVICES,
        tier_aggregators="a,b",
        **options,
    )
    return run_serve(settings, on_round)


def test_two_aggregators_over_bridged_brokers_train_the_single_coordinator_model(
    brokers: _Brokers, processes: Processes, tmp_path: Path
) -> None:
    # Prepare
    _start_sites(processes, brokers)
    # Execute
    served = _serve(brokers, tmp_path, rounds=2)
    # Per device, as the agents train: a batched simulation agrees only to float rounding.
    single = run_simulation(
        SimulationSettings.load(None, **RUN, rounds=2, devices=DEVICES, batched="off")
    )
    # Assert: every device's update reached the model through its site's aggregator, and the
    # weighted mean of the two partial sums equals the single coordinator's, bit for bit
    assert [r.participants for r in served.records] == [DEVICES, DEVICES]
    assert [r.scalars["tier_partials"] for r in served.records] == [2.0, 2.0]
    for name, tensor in single.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
    assert served.summary.metrics == single.summary.metrics
    # `pfl-coord status` on the core, as the read-only viewer: each site's aggregator, bridged
    rows = _status(brokers, tmp_path)["aggregators"]
    shown = [(r["aggregator"], r["round"], r["devices"], r["partial_sent"]) for r in rows]
    assert shown == [("a", 2, 2, True), ("b", 2, 2, True)]


def _status(brokers: _Brokers, cwd: Path) -> dict[str, Any]:
    """`pfl-coord status --json` on the core broker with the viewer's account."""
    viewer = brokers.result.viewer
    command = [
        sys.executable, "-m", "coordinator.cli.app", "status", "--json",
        "--broker", brokers.result.broker_url, "--username", viewer.username,
        "--password", viewer.password, "--ca-file", str(brokers.result.files["ca.crt"]),
    ]  # fmt: skip
    done = run_child(command, cwd)
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def test_a_lost_aggregator_costs_its_group_one_round_and_resumes(
    brokers: _Brokers, processes: Processes, tmp_path: Path
) -> None:
    # Prepare
    _start_sites(processes, brokers)

    site_log = brokers.log(brokers.ports["b"])
    announced = "Sending PUBLISH to pfl-aggregator-b (d0, q1, r0, m"

    def kill_b_mid_round_2() -> None:
        """SIGKILL aggregator b once round 2's announcement has reached it."""
        wait_for(
            lambda: (
                sum(
                    "'pfl/default/round'" in line
                    for line in site_log.read_text(errors="replace").splitlines()
                    if announced in line
                )
                >= 2
            ),
            "round 2 announced to aggregator b",
        )
        processes.running["aggregator-b"].kill()
        processes.running["aggregator-b"].wait(timeout=10)

    killer = threading.Thread(target=kill_b_mid_round_2)

    def on_round(record: RoundRecord) -> None:
        if record.round_id == 1:
            killer.start()
        if record.round_id == 2:  # b restarts before round 3
            killer.join()
            _aggregator(processes, brokers, "b")

    # Execute
    served = _serve(brokers, tmp_path, on_round, rounds=3, round_timeout=15.0, tier_grace=2.0)
    # Assert: round 2 closed at quorum on group a alone; b came back for round 3
    assert [r.participants for r in served.records] == [DEVICES, 2, DEVICES]
    assert [r.scalars["tier_missing"] for r in served.records] == [0.0, 1.0, 0.0]
    assert all(torch.isfinite(t).all() for t in served.final_shared.values())
