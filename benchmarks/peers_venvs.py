"""One virtual environment per peer framework, made (or reused) under a directory of the user's.

Each gets the CPU torch the project pins and the framework from PyPI, with the project's
constraints for shared pins, and no access to this environment's packages. A venv is reused
when its marker file names the same requirements; the peers are never dependencies of pfl-edge.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)
ROOT: Final = Path(__file__).resolve().parent.parent
CONSTRAINTS: Final = ROOT / "constraints.txt"
MARKER: Final = ".peer-requirements"


@dataclass(frozen=True)
class Peer:
    """A framework the workload also runs in: what to install, which runner, what to report."""

    label: str
    requirements: tuple[str, ...]
    module: str
    packages: tuple[str, ...]


TORCH: Final = "torch==2.13.0"
PEERS: Final = {
    "flower": Peer(
        "Flower simulation (Ray, 1 CPU per client)",
        (TORCH, "flwr[simulation]"),
        "benchmarks.peers.flower",
        ("flwr",),
    ),
    "pfl": Peer(
        "Apple pfl simulation (one process)",
        (TORCH, "pfl[pytorch]"),
        "benchmarks.peers.apple_pfl",
        ("pfl",),
    ),
}


def peer_python(root: Path, name: str, *, install: bool = True) -> Path:
    """The interpreter of peer `name`'s venv under `root`, made and installed if need be.

    Raises:
        RuntimeError: the venv is missing and `install` is off, or pip failed (its output).
    """
    peer = PEERS[name]
    home = root / name
    python = home / "bin" / "python"
    wanted = "\n".join(peer.requirements)
    marker = home / MARKER
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    if not install:
        msg = f"no virtual environment for {name} at {home} (run without --no-install)"
        raise RuntimeError(msg)
    logger.info("installing %s into %s", ", ".join(peer.requirements), home)
    venv.EnvBuilder(with_pip=True, clear=python.exists()).create(home)
    command = [str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS)]
    done = subprocess.run([*command, *peer.requirements], capture_output=True, text=True)
    if done.returncode != 0:
        msg = f"pip could not install {name}: {done.stderr.strip()[-2000:]}"
        raise RuntimeError(msg)
    marker.write_text(wanted)
    return python


def project_python() -> Path:
    """The interpreter pfl-edge runs in (the bare loop and the simulation run there too)."""
    return Path(sys.executable)
