"""The device agent on arm64, emulated on an x86 host: installed as a Pi user would, in a real run.

An arm64 Debian 12 userland (debootstrap, qemu-user through binfmt_misc: benchmarks/arm64_rootfs.py)
gets pfl-edge the way docs/deployment.md tells a Raspberry Pi user: a venv, torch for the board
first, then the project (this checkout's wheel). Then, on the host's loopback, a mosquitto, a real
`pfl-coord serve` (FedAlt with two FedAvg warm-up rounds) and two real `pfl-agent start`s: one in
the arm64 userland, one on the host. After the run the arm64 agent stops and `pfl-agent export`
writes its ONNX file there; onnxruntime on arm64 runs it, and the host runs the same file to
compare. The results table (versions, the arm64 hello, per-round times of both agents, the ONNX
check) goes into docs/deployment.md.

    python -m benchmarks.arm64_check [--cache DIR] [--torch SPEC] [--out docs/deployment.md]

Needs root (debootstrap, chroot, binfmt_misc, mounting /proc). The cache folder (PFL_ARM64_CACHE,
default /var/cache/pfl-arm64) keeps the root file system, the venvs and pip's cache: the first run
takes about 25 minutes on 2 cores (debootstrap ~8, torch and the dependencies installed under
emulation ~8 to 12, the run ~4), later runs about 4; another --torch makes a venv of its own
(~8 minutes once). Not part of pytest: emulation is far too slow for it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.arm64_fleet import ExportCheck, FleetRun, Recorder, start_mosquitto
from benchmarks.arm64_report import problems, raw, render
from benchmarks.arm64_rootfs import (
    Chroot,
    SetupError,
    ensure_binfmt,
    ensure_host_tools,
    ensure_rootfs,
    ensure_venv,
    mounted,
    run,
    venv_for,
)
from benchmarks.common import write_section

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- arm64-check -->"
DEFAULT_TORCH = "torch>=2.1,<2.11"
"""docs/deployment.md's PyPI-only recipe: from 2.11 on, PyPI's aarch64 torch is a CUDA build."""
BUDGET = "1GB"
"""Both agents' --memory-budget: the docs' MemoryMax=1G for a 2 GB board. Under qemu-user the
resident memory the planner starts from includes the emulator's translation cache (~130 MiB)."""
WORK = "/srv/pfl-arm64-check"
"""The run's folder inside the root file system (the host reads it through the rootfs path)."""


def build_wheel(cache: Path) -> Path:
    """This checkout's wheel, built from a copy so the work tree gains no build/ folder."""
    out = cache / "wheel"
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="pfl-arm64-src-") as directory:
        source = Path(directory) / "src"
        ignore = shutil.ignore_patterns(
            ".git", "runs", "build", "dist", "*.egg-info", "__pycache__"
        )
        shutil.copytree(REPO, source, ignore=ignore)
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        run([*command, "-q", "-w", str(out), str(source)], what="building the pfl-edge wheel")
    (wheel,) = out.glob("pfl_edge-*.whl")
    return wheel


def fleet(chroot: Chroot, work: Path, timeout: float) -> FleetRun:
    """mosquitto, the recorder, both agents and `pfl-coord serve`; the agents stopped after."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    mosquitto, url = start_mosquitto(work)
    recorder = Recorder(url)
    agents: dict[str, subprocess.Popen[bytes]] = {}
    serve_log = work / "serve.log"
    try:
        common = [
            "--broker",
            url,
            "--task",
            "digits",
            "--num-shards",
            "2",
            "--memory-budget",
            BUDGET,
        ]
        agents["pi-arm64"] = _spawn(
            chroot.command(
                ["pfl-agent", "start", "--device-id", "pi-arm64", "--data-shard", "0", *common,
                 "--state-dir", f"{WORK}/state"],
                {"OMP_NUM_THREADS": "1"},
            ),
            work / "pi-arm64.log",
        )  # fmt: skip
        agents["host-x86"] = _spawn(
            [sys.executable, "-m", "device_agent.cli", "start", "--device-id", "host-x86",
             "--data-shard", "1", *common, "--state-dir", str(work / "host-state")],
            work / "host-x86.log",
            env,
        )  # fmt: skip
        started = time.monotonic()
        with serve_log.open("wb") as log:
            serve = subprocess.run(
                [sys.executable, "-m", "coordinator.cli.app", "serve", "--broker", url,
                 "--task", "digits", "--algorithm", "fedalt", "--pretrain-rounds", "2",
                 "--rounds", "1", "--min-devices", "2", "--quorum", "1.0",
                 "--round-timeout", str(timeout), "--join-timeout", str(timeout),
                 "--out", str(work / "run"), "--checkpoint-dir", str(work / "checkpoint")],
                stdout=log, stderr=subprocess.STDOUT, env=env, timeout=6 * timeout, check=False,
            )  # fmt: skip
        serve_seconds = time.monotonic() - started
    finally:
        for process in agents.values():
            _stop(process)
        events = recorder.stop()
        mosquitto.terminate()
        mosquitto.wait(timeout=10)
    if serve.returncode != 0:
        msg = f"pfl-coord serve exited {serve.returncode}:\n{serve_log.read_text()[-3000:]}"
        raise SetupError(msg)
    return FleetRun(events, serve_seconds, work / "run")


def export_and_verify(chroot: Chroot, work: Path) -> ExportCheck:
    """`pfl-agent export` on arm64, the file run by onnxruntime on arm64 and on the host."""
    model = f"{WORK}/pi-arm64.onnx"
    started = time.monotonic()
    report = chroot.run(
        ["pfl-agent", "export", "--state-dir", f"{WORK}/state", "--out", model, "--task", "digits",
         "--data-shard", "0", "--num-shards", "2", "--json"],
        what="pfl-agent export on arm64",
    )  # fmt: skip
    export_seconds = time.monotonic() - started
    shutil.copyfile(REPO / "benchmarks" / "arm64_probe.py", work / "arm64_probe.py")
    arm = json.loads(chroot.run(["python", f"{WORK}/arm64_probe.py", model], what="arm64 probe"))
    host_env = f"PYTHONPATH={REPO}"
    host = json.loads(
        run(
            [
                "env",
                host_env,
                sys.executable,
                str(work / "arm64_probe.py"),
                str(work / "pi-arm64.onnx"),
            ],
            what="host probe",
        )
    )
    return ExportCheck(json.loads(report), export_seconds, arm, host)


def _spawn(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the agent finishes its work and says offline), SIGKILL after two minutes."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def install_line(torch_spec: str, pin: str) -> str:
    """The two pip lines this run made, as the report names them."""
    first = " ".join(f'"{word}"' for word in [*torch_spec.split(), *pin.split()])
    second = " ".join(["<pfl-edge wheel>", *(f'"{word}"' for word in pin.split())])
    return f"`pip install {first}`, then `pip install {second}`"


def main() -> None:
    """Set up (or reuse) the arm64 userland, run the fleet and the export, write the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("PFL_ARM64_CACHE", "/var/cache/pfl-arm64")),
    )
    parser.add_argument(
        "--torch",
        default=DEFAULT_TORCH,
        help='what the board\'s pip installs first, e.g. "torch==2.1.2"',
    )
    parser.add_argument(
        "--pin", default="", help='requirements for both pip lines, e.g. "numpy<2" for torch < 2.3'
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="round and join timeout, seconds"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "deployment.md")
    args = parser.parse_args()
    steps: dict[str, float] = {}

    def step(name: str, started: float) -> None:
        steps[name] = time.monotonic() - started
        print(f"{name}: {steps[name]:.0f} s", flush=True)

    started = time.monotonic()
    ensure_host_tools()
    flags = ensure_binfmt()
    root = ensure_rootfs(args.cache)
    step("rootfs", started)
    with mounted(root) as chroot:
        started = time.monotonic()
        venv = venv_for(f"{args.torch} {args.pin}".strip(), DEFAULT_TORCH)
        ensure_venv(chroot, venv, args.torch, build_wheel(args.cache), args.pin)
        step("install", started)
        work = chroot.host_path(WORK)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        started = time.monotonic()
        outcome = fleet(chroot, work, args.timeout)
        step("fleet run", started)
        started = time.monotonic()
        onnx = export_and_verify(chroot, work)
        step("export", started)
        debian = chroot.host_path("/etc/debian_version").read_text().strip()
    qemu = run(["qemu-aarch64-static", "--version"], what="qemu version").splitlines()[0]
    section = render(
        MARKER,
        outcome,
        onnx,
        debian=debian,
        qemu=qemu,
        binfmt=flags,
        install=install_line(args.torch, args.pin),
        budget=BUDGET,
        steps=steps,
    )
    (args.cache / "last-result.md").write_text(section + "\n")
    (args.cache / "last-result.json").write_text(json.dumps(raw(outcome, onnx), indent=2))
    found = problems(outcome, onnx)
    if found:  # a failed check leaves the docs as they were
        raise SetupError("the arm64 check failed:\n- " + "\n- ".join(found))
    write_section(args.out, section, MARKER)
    print(section)
    print("arm64 check passed")


if __name__ == "__main__":
    try:
        main()
    except SetupError as error:
        print(f"arm64 check failed: {error}", file=sys.stderr)
        sys.exit(1)
