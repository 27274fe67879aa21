"""The arm64 check's results as markdown: versions, the hellos, round times, the ONNX check."""

from __future__ import annotations

import dataclasses
import datetime
import platform
from collections.abc import Mapping
from pathlib import Path

from benchmarks.arm64_fleet import ExportCheck, FleetRun
from benchmarks.common import markdown_table
from protocols.messages import DeviceHello

ARM, HOST = "pi-arm64", "host-x86"
MIB = 1024 * 1024
HOST_DEBIAN = Path("/etc/debian_version")
ROUND_HEADER = ("round", "phase", "algorithm", "arm64 s", "host s", "arm64 / host")


def _plan(hello: DeviceHello) -> str:
    plan = hello.memory_plan
    if plan is None:
        return "none"
    return (
        f"budget {plan.budget_bytes / MIB:.0f} MiB, estimated peak "
        f"{plan.estimated_peak_bytes / MIB:.1f} MiB, micro-batch {plan.micro_batch_size} x "
        f"{plan.accumulation_steps} ({plan.method})"
    )


HELLO_ROWS = (
    "hello: arch",
    "hello: torch",
    "hello: Python",
    "hello: cores, free memory",
    "hello: memory plan",
    "hello: training samples",
)


def _hello_cells(hello: DeviceHello) -> list[str]:
    """One device's column of HELLO_ROWS."""
    found = hello.capabilities
    memory = f"{found.cores}, {found.memory_bytes / 2**30:.1f} GiB"
    return [found.arch, found.torch_version, found.python_version, memory, _plan(hello),
            str(hello.num_train_samples)]  # fmt: skip


def _hello_rows(outcome: FleetRun) -> list[list[str]]:
    hellos = outcome.events.hellos
    columns = zip(
        HELLO_ROWS, _hello_cells(hellos[ARM][1]), _hello_cells(hellos[HOST][1]), strict=True
    )
    rows = [list(row) for row in columns]
    rows.append(["start-up to hello", f"{hellos[ARM][0]:.1f} s", f"{hellos[HOST][0]:.1f} s"])
    return rows


def _round_rows(outcome: FleetRun) -> list[list[str]]:
    times: dict[tuple[int, str, str], dict[str, float]] = {}
    for answer in outcome.events.rounds:
        key = (answer.round_id, answer.phase, answer.algorithm)
        times.setdefault(key, {})[answer.device_id] = answer.seconds
    rows = []
    order = {"train": 0, "evaluate": 1}
    for (round_id, phase, algorithm), by_device in sorted(
        times.items(), key=lambda item: (item[0][0], order.get(item[0][1], 2))
    ):
        arm, host = by_device.get(ARM), by_device.get(HOST)
        ratio = f"{arm / host:.0f}x" if arm is not None and host else "-"
        rows.append([
            str(round_id), phase, algorithm,
            "-" if arm is None else f"{arm:.1f}", "-" if host is None else f"{host:.2f}", ratio,
        ])  # fmt: skip
    return rows


def _onnx_rows(onnx: ExportCheck) -> list[list[str]]:
    report, arm = onnx.report, onnx.arm
    difference = _output_difference(onnx)
    chosen = "global" if report["metrics"].get("chosen_global") else "personalized"
    exported = (
        f"ok={report['ok']}, {chosen} model of round {report['round_id']}, "
        f"{report['size_bytes']} bytes, {onnx.seconds:.0f} s"
    )
    ran = f"outputs {arm['output_shape']}, device {arm['device_id']}, round {arm['round']}"
    accuracy = report["metrics"]["exported"]
    return [
        ["`pfl-agent export` on arm64", exported],
        ["its parity check, torch vs onnxruntime on arm64", f"{report['parity_max_abs_diff']:.1e}"],
        ["held-out accuracy of the ONNX file (arm64 onnxruntime)", f"{accuracy:.3f}"],
        ["onnxruntime on arm64 runs the file", ran],
        ["the same file on the host: max abs output diff", f"{difference:.1e}"],
    ]


def render(
    marker: str,
    outcome: FleetRun,
    onnx: ExportCheck,
    *,
    debian: str,
    qemu: str,
    binfmt: str,
    install: str,
    budget: str,
    steps: Mapping[str, float],
) -> str:
    """The section between two `marker`s in docs/deployment.md."""
    arm, host = onnx.arm, onnx.host
    versions = [
        [
            "OS",
            f"Debian {debian} arm64 (debootstrap)",
            f"Debian {HOST_DEBIAN.read_text().strip()} {platform.machine()}",
        ],
        ["Python", arm["python"], host["python"]],
        *(
            [name, arm["versions"][name], host["versions"][name]]
            for name in ("torch", "onnxruntime", "onnx", "numpy")
        ),
    ]
    intro = (
        f"Measured {datetime.date.today().isoformat()} by `python -m benchmarks.arm64_check` "
        f"(the board's install: {install}), "
        f"{qemu}, binfmt_misc flags `{binfmt}`. Both agents run one torch thread "
        f"(`OMP_NUM_THREADS=1`) with `--memory-budget {budget}`; a round is timed on the host, "
        "from its announcement to the device's answer."
    )
    steps_line = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in steps.items())
    lines = [
        marker,
        intro,
        "",
        *markdown_table(["", ARM + " (emulated)", HOST], versions + _hello_rows(outcome)),
        "",
        *markdown_table(ROUND_HEADER, _round_rows(outcome)),
        "",
        *markdown_table(["ONNX check", "result"], _onnx_rows(onnx)),
        "",
        f"The served run took {outcome.serve_seconds:.0f} s; this check's steps: {steps_line}.",
        marker,
    ]
    return "\n".join(lines)


def raw(outcome: FleetRun, onnx: ExportCheck) -> dict[str, object]:
    """Everything measured, as JSON, kept beside the cache for a closer look."""
    return {
        "hellos": {
            device: {"after_s": after, "hello": hello.model_dump(mode="json")}
            for device, (after, hello) in outcome.events.hellos.items()
        },
        "rounds": [dataclasses.asdict(answer) for answer in outcome.events.rounds],
        "serve_seconds": outcome.serve_seconds,
        "export": dataclasses.asdict(onnx),
    }


EXPECTED_ROUNDS = ((1, "fedavg"), (2, "fedavg"), (3, "fedalt"))
"""Two FedAvg warm-up rounds, then FedAlt: what both devices must have trained."""
MAX_OUTPUT_DIFF = 1e-4


EXPECTED_ARCH = {ARM: "aarch64", HOST: platform.machine()}
"""What each agent's hello must say it runs on: the emulated board, and the host itself."""


def problems(outcome: FleetRun, onnx: ExportCheck) -> list[str]:
    """What the check requires and did not see; empty when the arm64 agent passed.

    A round counts as trained only by the device's update (phase "train"): an evaluation
    answer says the device is there, not that it trained.
    """
    found = []
    hellos = outcome.events.hellos
    if set(hellos) != {ARM, HOST}:
        found.append(f"hellos from {sorted(hellos)}, not both agents")
    for device, arch in EXPECTED_ARCH.items():
        said = hellos[device][1].capabilities.arch if device in hellos else None
        if device in hellos and said != arch:
            found.append(f"{device}'s hello says arch {said!r}, not {arch!r}")
    trained = {
        (a.round_id, a.algorithm, a.device_id) for a in outcome.events.rounds if a.phase == "train"
    }
    for round_id, algorithm in EXPECTED_ROUNDS:
        for device in (ARM, HOST):
            if (round_id, algorithm, device) not in trained:
                found.append(f"{device} did not train in {algorithm} round {round_id}")
    report, arm = onnx.report, onnx.arm
    if not report.get("ok") or report.get("parity_max_abs_diff", 1.0) > MAX_OUTPUT_DIFF:
        found.append(f"pfl-agent export on arm64 failed: {report.get('error') or report}")
    if arm.get("machine") != "aarch64" or arm.get("device_id") != ARM:
        found.append(f"the ONNX file ran on {arm.get('machine')} for {arm.get('device_id')}")
    if _output_difference(onnx) > MAX_OUTPUT_DIFF:
        found.append(f"arm64 and host outputs differ by {_output_difference(onnx):.1e}")
    return found


def _output_difference(onnx: ExportCheck) -> float:
    """Largest |arm64 - host| over the probe's outputs of the same file."""
    flat_arm = [value for row in onnx.arm["outputs"] for value in row]
    flat_host = [value for row in onnx.host["outputs"] for value in row]
    return float(max(abs(a - b) for a, b in zip(flat_arm, flat_host, strict=True)))
