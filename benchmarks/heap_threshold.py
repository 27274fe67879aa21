"""What glibc's mmap threshold does to a training step's peak memory and speed, per torch build.

glibc serves an allocation above its mmap threshold with a mapping of its own, returned to the
kernel when freed; below it, from the heap, where freed blocks stay resident for reuse. The
threshold is dynamic by default: freeing a mapped block raises it to that block's size (up to 32
MiB), so after the first steps a model's activations come from the heap. Whether freed
activations are then reused (checkpointing's recomputed blocks) or leave holes that raise the peak
depends on the torch build's allocation pattern. Setting the threshold (the environment variable
`MALLOC_MMAP_THRESHOLD_`, read when the process starts) makes it fixed: every larger tensor is
mapped and unmapped, so the resident set follows the live tensors, at the price of page faults on
every such allocation.

Each row is a fresh process (one torch thread) training 8 blocks whose 256-channel internals
dwarf their 4-channel boundaries (as the memory plan's checkpointing test does) on a batch of 256
signals: 2 warm-up SGD steps, the heap trimmed and the kernel's peak counter reset, then 10
steps. Peak = VmHWM over the resident set before those steps.

    python -m benchmarks.heap_threshold [--python PY ...] [--out docs/benchmarks.md]

`--python` names interpreters with torch installed (default: this one); each runs this file
alone, so another venv (e.g. the Python 3.10 one with constraints-oldest.txt) needs no checkout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

MARKER: Final = "<!-- heap-threshold -->"
THRESHOLDS: Final = (None, 1 << 20)
"""glibc's dynamic default, and a fixed 1 MiB."""
FORWARDS: Final = ("plain", "checkpointed")
BATCH: Final = 256
STEPS: Final = 10


def _child(forward: str) -> dict[str, object]:
    """One process's measurement; imports torch only here so the parent stays light."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(
            nn.Conv1d(4, 256, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(256, 256, 1),
            nn.ReLU(),
            nn.Conv1d(256, 4, 1),
        )
        for _ in range(8)
    ]
    model = nn.Sequential(*blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(BATCH, 4, 40)

    def step() -> None:
        hidden = inputs
        for block in blocks:
            hidden = (
                checkpoint(block, hidden, use_reentrant=False)
                if forward == "checkpointed"
                else block(hidden)
            )
        optimizer.zero_grad(set_to_none=True)
        hidden.square().mean().backward()
        optimizer.step()

    for _ in range(2):
        step()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    for _ in range(STEPS):
        step()
    elapsed = time.perf_counter() - started
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "ms_per_step": 1000 * elapsed / STEPS,
        "peak_mib": (peak - before) / 2**20,
    }


def _threshold_name(threshold: int | None) -> str:
    return "dynamic (default)" if threshold is None else f"fixed {threshold >> 10} KiB"


def _run(python: str, forward: str, threshold: int | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["OMP_NUM_THREADS"] = "1"
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    done = subprocess.run(
        [python, __file__, "--child", forward],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    """Measure every interpreter at both thresholds, plainly and checkpointed; write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--python", action="append", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child)))
        return
    from benchmarks.common import markdown_table, publish_section  # the parent's, from the checkout

    rows = []
    for python in args.python or [sys.executable]:
        for threshold in THRESHOLDS:
            for forward in FORWARDS:
                runs = [_run(python, forward, threshold) for _ in range(args.repeats)]
                first = runs[0]
                rows.append(
                    [
                        f"{first['torch']} (Python {first['python']})",
                        "dynamic (default)"
                        if threshold is None
                        else f"fixed {threshold >> 10} KiB",
                        forward,
                        f"{statistics.median(float(str(r['peak_mib'])) for r in runs):.0f}",
                        f"{statistics.median(float(str(r['ms_per_step'])) for r in runs):.0f}",
                    ]
                )
    header = ["torch", "glibc mmap threshold", "forward", "peak over runtime (MiB)", "ms / step"]
    lines = [
        "## Training memory and glibc's mmap threshold",
        "",
        f"8 blocks of Conv1d 4->256 (k=5), 256->256, 256->4 with ReLUs, a batch of {BATCH} "
        f"signals of length 40, {STEPS} SGD steps after 2 warm-up steps, one torch thread, "
        f"a fresh process per row, medians of {args.repeats}. Peak = VmHWM over the resident set "
        "before the measured steps (the heap trimmed first). A fixed threshold is set with "
        "`MALLOC_MMAP_THRESHOLD_` in the process's environment.",
        "",
        *markdown_table(header, rows),
        "",
        "Command: `python -m benchmarks.heap_threshold --python PY [--python PY2]`.",
    ]
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
