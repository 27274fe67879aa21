"""An arm64 Debian userland on an x86 host (qemu-user through binfmt_misc), kept between runs.

`debootstrap --arch=arm64` builds the root file system once; the kernel's binfmt_misc hands every
aarch64 ELF to `qemu-aarch64-static`, registered with the F flag so that it works inside a chroot
without a copy of qemu there. Processes run in the host's network namespace, so an agent in the
chroot reaches a broker on the host's 127.0.0.1. Everything cached (root file system, the venv,
pip's cache) lives under one folder outside git; needs root.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

SUITE = "bookworm"
"""Raspberry Pi OS 12 and the Debian 12 base of JetPack-era userlands: Python 3.11."""
MIRROR = "http://deb.debian.org/debian"
ROOTFS_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
HOST_PACKAGES = ("qemu-user-static", "debootstrap", "binfmt-support")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
VENV = "/opt/pfl-edge/venv"
"""Where docs/deployment.md tells a Pi or Jetson user to make the virtual environment."""
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
HOST_CA = "/etc/pfl-arm64/host-ca.crt"
"""The host's trust store, copied in: pip in the chroot trusts what the host's pip trusts."""
READY = ".pfl-rootfs-ready"


class SetupError(RuntimeError):
    """A step of the emulated set-up failed; the message says which and why."""


def run(command: Sequence[str], *, what: str, timeout: float = 3600) -> str:
    """Run a host command, returning its output; raise `SetupError` naming `what` on failure."""
    done = subprocess.run(
        list(command), capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        msg = f"{what} failed (exit {done.returncode}): {' '.join(command)}\n{tail}"
        raise SetupError(msg)
    return done.stdout


HOST_MODULES = ("torch", "onnxruntime", "paho", "typer", "sklearn", "pydantic_settings")
"""What the host's side imports: `pfl-coord serve`, the x86 agent (on --data-shard of digits)
and the ONNX probe all run from this checkout with the host's own Python packages."""
HOST_INSTALL = 'pip install -c constraints.txt -e ".[coord]"'
MOSQUITTO = Path("/usr/sbin/mosquitto")


def host_problems(
    find_spec: Callable[[str], object | None] = importlib.util.find_spec,
    mosquitto: Path = MOSQUITTO,
    euid: Callable[[], int] = os.geteuid,
) -> list[str]:
    """What the host lacks before anything is set up: root, the project's packages, mosquitto.

    Only the three emulation tools (HOST_PACKAGES) are installed by the check itself.
    """
    found = []
    if euid() != 0:
        found.append("run as root: debootstrap, chroot, binfmt_misc and mounting /proc need it")
    missing = [module for module in HOST_MODULES if find_spec(module) is None]
    if missing:
        found.append(
            f"install the project on the host first ({HOST_INSTALL} in the checkout): "
            f"{', '.join(missing)} cannot be imported"
        )
    if not mosquitto.exists():
        found.append(f"{mosquitto} is missing: apt-get install mosquitto")
    return found


def ensure_host_tools() -> None:
    """Install qemu-user-static, debootstrap and binfmt-support from Debian if any is missing."""
    if all(shutil.which(tool) for tool in ("qemu-aarch64-static", "debootstrap", "update-binfmts")):
        return
    run(["apt-get", "update", "-q"], what="apt-get update")
    run(["apt-get", "install", "-y", "-q", *HOST_PACKAGES], what="installing the host tools")


def ensure_binfmt() -> str:
    """Register qemu-aarch64 with binfmt_misc (mounting it first); return the entry's flags.

    Raises:
        SetupError: binfmt_misc cannot be mounted or the entry lacks the F (fix-binary) flag that
            a chroot without qemu inside needs.
    """
    if not (BINFMT / "status").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], what="mounting binfmt_misc")
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists():
        run(["update-binfmts", "--enable", "qemu-aarch64"], what="registering qemu-aarch64")
    text = entry.read_text()
    if not text.startswith("enabled"):
        run(["update-binfmts", "--enable", "qemu-aarch64"], what="enabling qemu-aarch64")
        text = entry.read_text()
    flags = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("flags:")),
        "",
    )
    if "F" not in flags:
        msg = f"binfmt entry qemu-aarch64 has flags {flags!r}; a chroot needs F (fix-binary)"
        raise SetupError(msg)
    return flags


def ensure_rootfs(cache: Path) -> Path:
    """The cached arm64 root file system, built with debootstrap the first time (~8 minutes)."""
    root = cache / "rootfs"
    if (root / READY).exists():
        return root
    partial = cache / "rootfs.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    command = [
        "debootstrap", "--arch=arm64", "--variant=minbase", f"--include={ROOTFS_PACKAGES}",
        SUITE, str(partial), MIRROR,
    ]  # fmt: skip
    run(command, what="debootstrap --arch=arm64", timeout=7200)
    (partial / READY).write_text(" ".join(command) + "\n")
    partial.rename(root)
    return root


class Chroot:
    """Commands run as arm64 processes in the root file system, with a clean environment."""

    def __init__(self, root: Path, env: Mapping[str, str]) -> None:
        self.root = root
        self.env = dict(env)

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """The host command line that runs `argv` inside (env -i: nothing leaks from the host)."""
        variables = [f"{key}={value}" for key, value in {**self.env, **(env or {})}.items()]
        return ["chroot", str(self.root), "/usr/bin/env", "-i", *variables, *argv]

    def run(self, argv: Sequence[str], *, what: str, timeout: float = 3600) -> str:
        """Run `argv` inside and return its output; `SetupError` naming `what` on failure."""
        return run(self.command(argv), what=what, timeout=timeout)

    def host_path(self, inside: str) -> Path:
        """Where a path inside the chroot is on the host."""
        return self.root / inside.lstrip("/")


MOUNTS = (("proc", "proc"),)
"""psutil reads /proc. /sys stays unmounted: qemu-user 7.2 shows an aarch64 process the host's
/proc/cpuinfo and /sys CPU topology, and the cpuinfo library in onnxruntime 1.32 segfaults on
import when it parses x86 topology as ARM; without /sys it gives up early with a warning, and
onnxruntime and torch fall back to their generic kernels (a Pi's own /sys is ARM and parses)."""


@contextmanager
def mounted(root: Path) -> Iterator[Chroot]:
    """/proc mounted, DNS and the host's CA copied in; unmounted after."""
    ours: list[Path] = []
    try:
        for kind, where in MOUNTS:
            target = root / where
            if not os.path.ismount(target):
                run(
                    ["mount", "-t", kind, kind, str(target)],
                    what=f"mounting /{where} in the rootfs",
                )
                ours.append(target)
        shutil.copyfile("/etc/resolv.conf", root / "etc/resolv.conf")
        (root / HOST_CA.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", root / HOST_CA.lstrip("/"))
        env = {
            "HOME": "/root",
            "PATH": BASE_PATH,
            "LANG": "C.UTF-8",
            "PIP_CERT": HOST_CA,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_DEFAULT_TIMEOUT": "180",
        }
        yield Chroot(root, env)
    finally:
        for target in reversed(ours):
            subprocess.run(["umount", "-l", str(target)], check=False)


def venv_for(torch_spec: str, default_spec: str) -> str:
    """The docs' venv for the default torch; one beside it for each other spec, kept too."""
    if torch_spec == default_spec:
        return VENV
    return f"{VENV}-{hashlib.sha256(torch_spec.encode()).hexdigest()[:8]}"


def ensure_venv(chroot: Chroot, venv: str, torch_spec: str, wheel: Path, pins: str = "") -> None:
    """Install as docs/deployment.md says: a venv, torch for the board first, then pfl-edge.

    `torch_spec` is what the board's first `pip install` gets, e.g. "torch==2.1.2 numpy<2";
    `pins` go on the second one too (the resolver would otherwise lift numpy again). A
    venv that holds another spec is made afresh, as a board would be. Each step is skipped when
    its stamp says it is done with the same inputs; pip's cache stays in the root file system.
    Afterwards `chroot` runs this venv's commands first on its PATH.
    """
    stamps = chroot.host_path(venv) / "pfl-stamps"
    if _stale(stamps / "torch", torch_spec):
        shutil.rmtree(chroot.host_path(venv), ignore_errors=True)
        chroot.run(["/usr/bin/python3", "-m", "venv", venv], what="python3 -m venv")
        pip_install = [f"{venv}/bin/pip", "install", *torch_spec.split(), *pins.split()]
        chroot.run(pip_install, what=f"pip install {torch_spec}")
        stamps.mkdir()
        (stamps / "torch").write_text(torch_spec)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if _stale(stamps / "pfl-edge", digest):
        inside = f"/tmp/{wheel.name}"
        shutil.copyfile(wheel, chroot.host_path(inside))
        pip = f"{venv}/bin/pip"
        # The dependencies first, then this checkout's code even when the version is unchanged.
        chroot.run([pip, "install", inside, *pins.split()], what="pip install pfl-edge")
        chroot.run(
            [pip, "install", "--no-deps", "--force-reinstall", inside], what="reinstalling pfl-edge"
        )
        (stamps / "pfl-edge").write_text(digest)
    chroot.env["PATH"] = f"{venv}/bin:{BASE_PATH}"


def _stale(stamp: Path, value: str) -> bool:
    return not stamp.exists() or stamp.read_text() != value
