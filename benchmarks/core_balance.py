"""How evenly this machine's cores run, and what that costs a round split evenly between them.

A simulation gives each worker a fixed share of the devices, so a round lasts as long as the
slower worker's share takes. On shared or throttled machines two cores do not run at one speed:
here each core runs the same training step in its own pinned process at the same time, counting
steps per window. From those counts, `split_efficiency` replays rounds of a given length: each
core does half the round's steps at its own measured speed, the round ends with the slower one,
against an ideal that pools both cores' steps. Short rounds see every swing in speed; long ones
average them out.

    python -m benchmarks.core_balance [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from device_agent.compute_threads import available_cores
from pfl_tasks.synthetic import DIMENSION, NUM_CLASSES, SyntheticTask

WINDOW_S = 0.25
BATCH = 10


def cpu_jiffies() -> tuple[int, int] | None:
    """(stolen, all) time of every CPU since boot, from /proc/stat; None where there is none.

    "Stolen" is time the hypervisor ran something else while this machine's vCPU wanted to run.
    """
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    stolen = fields[7] if len(fields) > 7 else 0
    return stolen, sum(fields[:8])


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """The share of CPU time the hypervisor took between two `cpu_jiffies` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return "unknown"
    return f"{(after[0] - before[0]) / (after[1] - before[1]):.1%}"


def split_efficiency(
    first: Sequence[float], second: Sequence[float], window_s: float, round_s: float
) -> float:
    """Ideal over actual time of back-to-back rounds, each split evenly between two cores.

    `first` and `second` are the steps each core did in consecutive windows of `window_s`
    (both busy throughout). A round is `round_s` of both cores' mean pooled throughput; each
    core must do half of it, starting when the previous round ended. 1.0: no loss; two
    constant speeds r and s give 2 * min(r, s) / (r + s).

    Raises:
        ValueError: series of different lengths, non-positive counts, or a round longer than
            the series.
    """
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or not len(a) or (a <= 0).any() or (b <= 0).any():
        msg = "two equally long series of positive step counts are needed"
        raise ValueError(msg)
    edges = np.arange(len(a) + 1) * window_s
    done_a = np.concatenate([[0.0], np.cumsum(a)])
    done_b = np.concatenate([[0.0], np.cumsum(b)])
    work = round_s * (done_a[-1] + done_b[-1]) / edges[-1]
    if work > min(done_a[-1], done_b[-1]):
        msg = f"a {round_s} s round does not fit twice into {edges[-1]} s of measurement"
        raise ValueError(msg)

    def finished(done: np.ndarray, start: float, steps: float) -> float:
        return float(np.interp(np.interp(start, edges, done) + steps, done, edges))

    now, rounds = 0.0, 0
    while True:
        end = max(finished(done_a, now, work / 2), finished(done_b, now, work / 2))
        if end >= edges[-1]:
            break
        now, rounds = end, rounds + 1
    ideal = finished(done_a + done_b, 0.0, rounds * work)
    return ideal / now if rounds else 1.0


def steps_per_window(cpu: int, seconds: float) -> list[int]:
    """Training steps of the synthetic task's model this process does on `cpu` per window."""
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    task = SyntheticTask()
    model = task.build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(cpu)
    inputs = torch.randn(BATCH, DIMENSION, generator=generator)
    targets = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    counts: list[int] = []
    end = time.monotonic() + seconds
    while (start := time.monotonic()) < end:
        steps = 0
        while time.monotonic() - start < WINDOW_S:
            optimizer.zero_grad()
            task.loss(model(inputs), targets).backward()
            optimizer.step()
            steps += 1
        counts.append(steps)
    return counts


def both_cores(seconds: float) -> tuple[list[int], list[int]]:
    """Step counts of two of this process's cores over the same `seconds`, each pinned.

    The first two cores of its affinity: a process confined to cores 2 and 3 may not pin to 0.
    """
    command = [sys.executable, "-m", "benchmarks.core_balance", "--seconds", str(seconds)]
    runs = [
        subprocess.Popen([*command, "--cpu", str(cpu)], stdout=subprocess.PIPE, text=True)
        for cpu in sorted(os.sched_getaffinity(0))[:2]
    ]
    first, second = (json.loads(run.communicate()[0]) for run in runs)
    length = min(len(first), len(second))
    return first[:length], second[:length]


def rows(seconds: float, round_lengths: Sequence[float]) -> list[str]:
    """Table rows: per round length, the share of two cores' throughput an even split gets."""
    before = cpu_jiffies()
    first, second = both_cores(seconds)
    stolen = stolen_share(before, cpu_jiffies())
    ratios = np.minimum(first, second) / np.maximum(first, second)
    table = [
        f"| windows of {WINDOW_S} s | {len(ratios)} | slower / faster core: median "
        f"{np.median(ratios):.2f}, worst {ratios.min():.2f}; taken by the hypervisor: "
        f"{stolen} |"
    ]
    for round_s in round_lengths:
        efficiency = split_efficiency(first, second, WINDOW_S, round_s)
        table.append(f"| rounds of {round_s} s | | even split gets {efficiency:.1%} |")
    return table


def main() -> None:
    """Measure both cores (or, with --cpu, be one of the two measuring processes)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--cpu", type=int, default=None)
    args = parser.parse_args()
    if args.cpu is not None:
        print(json.dumps(steps_per_window(args.cpu, args.seconds)))
        return
    if available_cores() < 2 or not hasattr(os, "sched_setaffinity"):
        print("needs two cores this process may pin to")
        return
    print("\n".join(rows(args.seconds, (0.5, 5.0))))


if __name__ == "__main__":
    main()
