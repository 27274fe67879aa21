"""What this machine offers a training round: cores, memory (cgroup limits included), versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import psutil
import torch

from protocols.messages import Capabilities

_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def available_memory_bytes() -> int:
    """Memory this process may still use: the smaller of free RAM and the cgroup's headroom."""
    available = int(psutil.virtual_memory().available)
    for limit_path in _CGROUP_LIMITS:
        try:
            text = limit_path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            usage_path = limit_path.with_name(
                "memory.current" if limit_path.name == "memory.max" else "memory.usage_in_bytes"
            )
            try:
                used = int(usage_path.read_text().strip())
            except (OSError, ValueError):
                used = 0
            available = min(available, max(0, int(text) - used))
    return available


def usable_cores() -> int:
    """Cores this process may run on (affinity-aware where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def probe_capabilities() -> Capabilities:
    """This machine's capabilities, as sent in the hello."""
    return Capabilities(
        cores=usable_cores(),
        memory_bytes=available_memory_bytes(),
        arch=platform.machine() or "unknown",
        torch_version=torch.__version__.split("+")[0],
        python_version=platform.python_version(),
    )


def require_numpy_bridge() -> None:
    """Fail at start, saying how to fix it, when torch cannot exchange arrays with this NumPy.

    torch wheels before 2.3 (and board builds made the same way) were compiled against NumPy 1.x
    and cannot use NumPy 2, which pfl-edge's `numpy>=1.24` lets pip install beside them. Every
    shard, data directory and export goes through `torch.from_numpy`, which then fails deep in
    loading with a bare "Numpy is not available".

    Raises:
        ValueError: torch cannot use the installed NumPy.
    """
    try:
        torch.from_numpy(np.zeros(1, dtype=np.float32))
    except RuntimeError as error:
        msg = (
            f"torch {torch.__version__} cannot use NumPy {np.__version__} ({error}): that torch "
            "was built against NumPy 1.x; install 'numpy<2' beside it, or torch 2.3 or newer "
            "(docs/deployment.md, Raspberry Pi and Jetson)"
        )
        raise ValueError(msg) from error
