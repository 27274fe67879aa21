"""What `serve` and agents print at start, per round, at a normal end, on Ctrl-C, and when idle.

Real processes on the embedded broker; their output is what is asserted. The idle notice is
checked on the provisioned mosquitto, whose ACL silently denies another fleet's topics.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from device_agent.coordinator_watch import CoordinatorWatch
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import CoordinatorStatus
from protocols.transport.mqtt import MqttTransport
from tests.conftest import free_port, wait_for_port
from tests.e2e.conftest import CEILING_S, Processes, child_env, sourced, wait_for
from tests.provisioned import start_provisioned

pytestmark = pytest.mark.timeout(600)


def one_line(text: str) -> str:
    """Output with rich's wrapping undone: every run of whitespace one space."""
    return " ".join(text.split())


def start_fleet(processes: Processes, tmp_path: Path, rounds: int) -> tuple[str, list[str]]:
    """`serve` on an embedded broker and two agents from its device.env; their log names."""
    port = free_port()
    processes.start(
        "serve",
        [
            sys.executable, "-m", "coordinator.cli.app", "serve", "--port", str(port),
            "--task", "digits", "--algorithm", "fedavg", "--rounds", str(rounds),
            "--min-devices", "2", "--round-timeout", "60", "--join-timeout", str(CEILING_S),
            "--out", "run", "--checkpoint-dir", "checkpoint",
        ],
        {"COLUMNS": "250"},
    )  # fmt: skip
    assert wait_for_port(port, timeout_s=CEILING_S), processes.log("serve")
    env = {**sourced(tmp_path / "run" / "broker" / "device.env"), "COLUMNS": "250"}
    agents = []
    for index in range(2):
        name = f"dev-{index}"
        processes.start(
            name,
            [
                sys.executable, "-m", "device_agent.cli", "start", "--device-id", name,
                "--task", "digits", "--data-shard", str(index), "--num-shards", "2",
                "--state-dir", str(tmp_path / "state" / name),
            ],
            env,
        )  # fmt: skip
        agents.append(name)
    return f"mqtt://127.0.0.1:{port}", agents


def test_serve_and_agents_say_who_they_are_each_round_and_end_quietly(
    processes: Processes, tmp_path: Path
) -> None:
    # Prepare / Execute: a whole 3-round run, then the agents stopped
    url, agents = start_fleet(processes, tmp_path, rounds=3)
    serve = processes.running["serve"]
    serve.wait(timeout=CEILING_S * 2)
    wait_for(
        lambda: all("has finished" in processes.log(name) for name in agents),
        "the agents noticing the end",
    )
    for name in agents:
        processes.running[name].send_signal(signal.SIGINT)
        processes.running[name].wait(timeout=CEILING_S)
    # Assert
    served = one_line(processes.log("serve"))
    assert serve.returncode == 0, served
    assert f"coordinator pfl-coord-default on {url}, fleet default, user pfl-coordinator" in served
    for round_id in (1, 2, 3):
        assert f"round {round_id} of 3: 2 of 2 selected answered, loss " in served
    for name in agents:
        said = one_line(processes.log(name))
        assert f"device {name} on {url}, fleet default, user pfl-device" in said
        assert "PFL_ variables set: PFL_BROKER, PFL_FLEET, PFL_PASSWORD, PFL_USERNAME" in said
        for round_id in (1, 2, 3):
            assert f"device {name}: round {round_id} trained, loss " in said
        assert "the coordinator of fleet 'default' has finished and its broker closed" in said
        assert "lost its connection" not in said
        assert "WARNING" not in said, said
        assert "ERROR" not in said, said
        assert "Traceback" not in said
        assert "Exception ignored" not in said


def test_ctrl_c_of_serve_says_the_round_and_the_resume_command(
    processes: Processes, tmp_path: Path
) -> None:
    # Prepare
    start_fleet(processes, tmp_path, rounds=500)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, "round 2")
    # Execute
    serve = processes.running["serve"]
    serve.send_signal(signal.SIGINT)
    serve.wait(timeout=CEILING_S)
    # Assert
    said = one_line(processes.log("serve"))
    assert serve.returncode == 130, said
    assert "Traceback" not in said
    assert "stopped after round " in said
    assert "of 500 (checkpoint in checkpoint); continue with: pfl-coord serve --port" in said
    assert said.endswith("--out run --checkpoint-dir checkpoint --resume"), said[-300:]
    assert "Exception ignored" not in said


@pytest.mark.mosquitto
def test_an_agent_denied_its_fleet_says_why_it_may_be_idle(tmp_path: Path) -> None:
    # Prepare: dev-1 provisioned for fleet lab; a coordinator's retained status in lab
    broker = start_provisioned(tmp_path / "deploy", ["dev-1"], "lab")
    device, coordinator = broker.result.devices["dev-1"], broker.result.coordinator
    now = [0.0]
    try:
        with (
            MqttTransport(
                broker.settings(coordinator.username, coordinator.password), "pfl-coord-lab"
            ) as coord,
            MqttTransport(broker.settings(device.username, device.password), "dev-1") as agent,
        ):
            status = CoordinatorStatus(state="finished", fleet="lab", task="digits", round_id=3)
            coord.publish(topics.coordinator_status("lab"), encode_frame(status), retain=True)
            # Execute: the device listening as fleet "default" (denied), then as "lab"
            astray = CoordinatorWatch("device dev-1", "default", "mqtts://x", 60.0, lambda: now[0])
            astray.listen(agent)
            home = CoordinatorWatch("device dev-1", "lab", "mqtts://x", 60.0, lambda: now[0])
            home.listen(agent)
            wait_for(lambda: home.coordinator_state == "finished", "lab's coordinator status")
            now[0] = 59.0
            early = astray.check()
            now[0] = 61.0
            warning, again, quiet = astray.check(), astray.check(), home.check()
    finally:
        broker.stop()
    # Assert: one warning, naming the fleet, the flag and the ACL; none for the right fleet
    assert early is None
    assert warning is not None
    assert warning.startswith("device dev-1 has received nothing from a coordinator")
    assert "fleet 'default'" in warning
    assert "--fleet NAME (or PFL_FLEET)" in warning
    assert "ACL" in warning
    assert again is None
    assert quiet is None


def test_a_lost_connection_is_a_warning_until_the_coordinator_has_ended() -> None:
    watch = CoordinatorWatch("device dev-1", "lab", "mqtt://x")
    transport_logger = logging.getLogger("protocols.transport.mqtt")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    transport_logger.addHandler(handler)
    try:
        with watch.quiet_normal_end():
            transport_logger.warning("%s lost its connection to %s", "dev-1", "mqtt://x")
            watch.coordinator_state = "finished"
            transport_logger.warning("%s lost its connection to %s", "dev-1", "mqtt://x")
            transport_logger.warning("%s lost its connection to %s", "dev-2", "mqtt://x")
        transport_logger.warning("%s lost its connection to %s", "dev-1", "mqtt://x")
    finally:
        transport_logger.removeHandler(handler)
    assert [r.levelname for r in seen] == ["WARNING", "INFO", "WARNING"]  # dev-2's: no line
    assert "has finished and its broker closed the connection" in seen[1].getMessage()


def test_an_offline_export_of_a_shard_needs_the_number_of_shards(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "device_agent.cli", "export", "--out", str(tmp_path / "m.onnx"),
        "--task", "digits", "--device-id", "dev-1", "--state-dir", str(tmp_path / "state"),
        "--data-shard", "0",
    ]  # fmt: skip
    env = {k: v for k, v in child_env().items() if not k.startswith("PFL_")}
    done = subprocess.run(
        command, env={**env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=CEILING_S
    )
    said = one_line(done.stdout + done.stderr)
    assert done.returncode == 2, said
    assert "error: --data-shard 0 needs --num-shards" in said
    assert "the default split of 20 shards" in said
    assert "Traceback" not in said
    assert not (tmp_path / "m.onnx").exists()


def test_a_pool_says_who_it_is_and_its_normal_end_in_one_line(
    processes: Processes, tmp_path: Path
) -> None:
    # Prepare / Execute: a 2-round run of six devices in one pool process
    port = free_port()
    serve = processes.start(
        "serve",
        [
            sys.executable, "-m", "coordinator.cli.app", "serve", "--port", str(port),
            "--task", "digits", "--algorithm", "fedavg", "--rounds", "2", "--min-devices", "6",
            "--round-timeout", "60", "--join-timeout", str(CEILING_S), "--out", "run",
            "--checkpoint-dir", "checkpoint",
        ],
        {"COLUMNS": "250"},
    )  # fmt: skip
    assert wait_for_port(port, timeout_s=CEILING_S), processes.log("serve")
    env = {**sourced(tmp_path / "run" / "broker" / "device.env"), "COLUMNS": "250"}
    pool = processes.start(
        "pool",
        [
            sys.executable, "-m", "device_agent.cli", "pool", "--task", "digits",
            "--devices", "0-5", "--num-shards", "6",
        ],
        env,
    )  # fmt: skip
    serve.wait(timeout=CEILING_S * 2)
    wait_for(lambda: "has finished" in processes.log("pool"), "the pool noticing the end")
    pool.send_signal(signal.SIGINT)
    pool.wait(timeout=CEILING_S)
    # Assert
    said = one_line(processes.log("pool"))
    assert serve.returncode == 0, processes.log("serve")
    assert pool.returncode == 0, said
    assert "pool of 6 devices (0-5) on mqtt://127.0.0.1:" in said
    assert said.count("has finished and its broker closed the connection") == 1, said
    assert "lost its connection" not in said
    assert "WARNING" not in said, said
    assert "Traceback" not in said
