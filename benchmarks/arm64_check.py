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

Host prerequisites, checked first (`host_problems`): root (debootstrap, chroot, binfmt_misc,
mounting /proc), this checkout installed on the host (`pip install -c constraints.txt -e
".[coord]"`: serve, the x86 agent and the probe run from it) and Debian's mosquitto. The check
installs qemu-user-static, debootstrap and binfmt-support itself and leaves them, the qemu-aarch64
binfmt_misc entry and the cache behind (docs/deployment.md says how to remove them). The wheel is
rebuilt only when its sources changed (`source_digest`). The cache folder (PFL_ARM64_CACHE, default
/var/cache/pfl-arm64) keeps the root file system, the venvs and pip's cache: the first run takes
about 25 minutes on 2 cores (debootstrap ~8, torch and the dependencies installed under emulation ~8
to 12, the run ~4), later runs about 4; another --torch makes a venv of its own (~8 minutes once).
Not part of pytest: emulation is far too slow for it.
"""

from __future__ import annotations

import argparse
import hashlib
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
    host_problems,
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


PACKAGED = ("coordinator", "device_agent", "export", "pfl_tasks", "protocols")
"""The folders the wheel is built from (pyproject.toml's packages), with BUILD_FILES."""
BUILD_FILES = ("pyproject.toml", "MANIFEST.in", "README.md")


def source_digest(root: Path = REPO) -> str:
    """A digest of what the wheel is built from: equal digests give the same wheel contents."""
    digest = hashlib.sha256()
    files = [root / name for name in BUILD_FILES if (root / name).exists()]
    for folder in PACKAGED:
        files += [p for p in (root / folder).rglob("*") if p.is_file() and _packaged(p)]
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _packaged(path: Path) -> bool:
    return "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")


def build_wheel(cache: Path) -> Path:
    """This checkout's wheel, built from a copy so the work tree gains no build/ folder.

    Kept in the cache with the digest of its sources: an unchanged checkout reuses it, so the
    venv's stamp (the wheel's bytes) matches and pfl-edge is not reinstalled.
    """
    out = cache / "wheel"
    digest = source_digest()
    stamp = out / "source-digest"
    wheels = sorted(out.glob("pfl_edge-*.whl"))
    if len(wheels) == 1 and stamp.exists() and stamp.read_text() == digest:
        return wheels[0]
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
    stamp.write_text(digest)
    return wheel


BOARD_DATA = ("--data", f"{WORK}/pi-data", "--data-shard", "0")
"""The board's own data directory, as a real device has (`--data DIR`): shard 0 of 2, written
on the host, so the board's agent-only install needs no scikit-learn for the digits data."""


def write_board_data(directory: Path) -> None:
    """Shard 0 of 2 of digits, exactly as `--data-shard 0 --num-shards 2` gives it, as .npz."""
    from device_agent.runner import load_data
    from device_agent.settings import AgentSettings
    from pfl_tasks.datadir import save_device_data
    from pfl_tasks.registry import load_task

    settings = AgentSettings.load(
        None, device_id="pi-arm64", task="digits", data_shard=0, num_shards=2
    )
    save_device_data(load_data(settings, load_task("digits")), directory)


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
        write_board_data(work / "pi-data")
        agents["pi-arm64"] = _spawn(
            chroot.command(
                ["pfl-agent", "start", "--device-id", "pi-arm64", *BOARD_DATA, *common,
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
         *BOARD_DATA, "--num-shards", "2", "--json"],
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


def install_line(torch_spec: str, pin: str, wheel: str) -> str:
    """The two pip lines this run made (the wheel as copied into the board), for the report."""
    first = " ".join(f'"{word}"' for word in [*torch_spec.split(), *pin.split()])
    second = " ".join([f"/tmp/{wheel}", *(f'"{word}"' for word in pin.split())])
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

    missing = host_problems()
    if missing:
        raise SetupError("the host is not ready:\n- " + "\n- ".join(missing))
    started = time.monotonic()
    ensure_host_tools()
    flags = ensure_binfmt()
    root = ensure_rootfs(args.cache)
    step("rootfs", started)
    with mounted(root) as chroot:
        started = time.monotonic()
        venv = venv_for(f"{args.torch} {args.pin}".strip(), DEFAULT_TORCH)
        wheel = build_wheel(args.cache)
        ensure_venv(chroot, venv, args.torch, wheel, args.pin)
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
        install=install_line(args.torch, args.pin, wheel.name),
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
