"""The arm64 check's verdict and host checks, on recorded events (the check itself needs qemu).

`python -m benchmarks.arm64_check` runs for minutes under emulation and is not part of pytest;
what decides whether it passed (`problems`), what it requires of the host (`host_problems`) and
when it rebuilds the wheel (`source_digest`) are plain functions, tested here.
"""

from __future__ import annotations

import platform
from pathlib import Path

from benchmarks.arm64_check import source_digest
from benchmarks.arm64_fleet import Events, ExportCheck, FleetRun, RoundTime
from benchmarks.arm64_report import ARM, EXPECTED_ROUNDS, HOST, problems
from benchmarks.arm64_rootfs import HOST_INSTALL, host_problems
from protocols.messages import Capabilities, DeviceHello

PHASES = ("train", "evaluate")


def _hello(device: str, arch: str) -> tuple[float, DeviceHello]:
    found = Capabilities(
        cores=2, memory_bytes=2**30, arch=arch, torch_version="2.10.0", python_version="3.11.2"
    )
    return 1.0, DeviceHello(
        device_id=device, task="digits", num_train_samples=599, capabilities=found
    )


def _run(
    phases: tuple[str, ...] = PHASES, arm_arch: str = "aarch64", skip: tuple[int, str] | None = None
) -> FleetRun:
    events = Events(hellos={ARM: _hello(ARM, arm_arch), HOST: _hello(HOST, platform.machine())})
    for round_id, algorithm in EXPECTED_ROUNDS:
        for device in (ARM, HOST):
            for phase in phases:
                if (round_id, device) != skip:
                    events.rounds.append(RoundTime(round_id, phase, algorithm, device, 0.5))
    return FleetRun(events, 10.0, Path("run"))


def _onnx() -> ExportCheck:
    report = {"ok": True, "parity_max_abs_diff": 0.0, "metrics": {"exported": 0.96}}
    arm = {"machine": "aarch64", "device_id": ARM, "outputs": [[0.1, 0.2]]}
    return ExportCheck(report, 3.0, arm, {"machine": "x86_64", "outputs": [[0.1, 0.2]]})


def test_a_run_where_both_agents_trained_every_round_passes() -> None:
    assert problems(_run(), _onnx()) == []


def test_evaluation_answers_alone_do_not_count_a_round_as_trained() -> None:
    found = problems(_run(phases=("evaluate",)), _onnx())
    assert len(found) == 2 * len(EXPECTED_ROUNDS)
    assert f"{ARM} did not train in fedalt round 3" in found


def test_one_missing_update_is_named() -> None:
    assert problems(_run(skip=(2, ARM)), _onnx()) == [f"{ARM} did not train in fedavg round 2"]


def test_a_board_hello_that_is_not_aarch64_fails_the_check() -> None:
    found = problems(_run(arm_arch=platform.machine()), _onnx())
    assert found == [f"{ARM}'s hello says arch {platform.machine()!r}, not 'aarch64'"]


def test_the_host_prerequisites_are_each_named() -> None:
    assert host_problems(lambda name: object(), Path(__file__), lambda: 0) == []
    found = host_problems(
        lambda name: None if name == "sklearn" else object(), Path("/nonexistent"), lambda: 1000
    )
    assert len(found) == 3
    assert found[0].startswith("run as root")
    assert HOST_INSTALL in found[1]
    assert found[1].endswith("sklearn cannot be imported")
    assert "apt-get install mosquitto" in found[2]


def test_the_wheel_digest_changes_with_a_packaged_file_only(tmp_path: Path) -> None:
    for package in ("coordinator", "device_agent", "export", "pfl_tasks", "protocols"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"# {package}\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    before = source_digest(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("not in the wheel\n")
    (tmp_path / "protocols" / "__pycache__").mkdir()
    (tmp_path / "protocols" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert source_digest(tmp_path) == before
    (tmp_path / "protocols" / "__init__.py").write_text("# changed\n")
    assert source_digest(tmp_path) != before
