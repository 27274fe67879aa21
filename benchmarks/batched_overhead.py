"""Batched against per-device simulation and a bare PyTorch loop: in-run and whole-process time.

Workloads: the digits MLP of `benchmarks.simulation_overhead` (FedAvg, 50 devices, 20 rounds), a
small 1-D CNN over the same digits (each 8x8 image read as a 64-step sequence; 50 devices, 5
rounds) and an MLP over 1,000 synthetic devices (2 rounds). One worker, so every device trains
in one process. Paths: `pfl-coord simulate --batched on` (each round's local updates as one
stacked computation), `--batched off` (each device in turn), the bare loop, and the bare loop
with its local SGD stacked (`train_stacked`, no coordinator, codec or hub), alone and with
each device's update encoded and decoded under the receiver's checks. In-run: the run
alone, in a warm process. Whole process: a fresh `python` doing the same from its first import.
Runs alternate; medians of the repeats.

`--threshold` instead times `--batched on` against `off` on the digits MLP by hidden width,
the measurement behind `device_agent.batched.choice.AUTO_MAX_STEP_MACS`; `--before-root DIR`
times the digits MLP's bare loop, `off` and `on` in this checkout and in DIR side by side.

    OMP_NUM_THREADS=1 nice python -m benchmarks.batched_overhead [--repeats 3]
        [--threshold | --before-root DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import write_section
from benchmarks.simulation_overhead import WORKLOAD, bare_loop, mean_test_metric, simulated_fleet
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.algorithms.base import BatchPhase
from device_agent.batched.stacked import Member, Trained, train_stacked
from device_agent.batched.trainer import Batched
from device_agent.compute_threads import available_cores, largest_step_macs
from device_agent.training import TrainSpec, difference
from pfl_tasks.digits import DigitsTask
from pfl_tasks.models import build_seeded
from pfl_tasks.registry import load_task
from pfl_tasks.synthetic import SyntheticTask
from protocols.codec import Tensors, describe_tensors, pack_tensors, unpack_tensors
from protocols.messages import TensorSpec
from protocols.privacy import update_norm
from protocols.transport.inprocess import InProcessBroker

MARKER = "<!-- batched-overhead -->"
THRESHOLD_MARKER = "<!-- batched-threshold -->"
WIRE_MARKER = "<!-- batched-wire-path -->"
MODES = ("bare", "stacked", "wire", "off", "on")
WORKLOADS: dict[str, dict[str, Any]] = {
    "digits MLP, 50 devices, 20 rounds": WORKLOAD,
    "digits 1-D CNN, 50 devices, 5 rounds": {
        **WORKLOAD,
        "task": "benchmarks.batched_overhead:ConvDigits",
        "rounds": 5,
    },
    "synthetic MLP, 1,000 devices, 2 rounds": {
        **WORKLOAD,
        "task": "benchmarks.batched_overhead:SmallSynthetic",
        "devices": 1000,
        "rounds": 2,
    },
}


class ConvDigits(DigitsTask):
    """The digits task with a small 1-D CNN: each image is a 64-step, one-channel sequence."""

    def build_model(self, seed: int) -> nn.Module:
        """Two convolutions and a linear read-out (20,426 parameters)."""
        return build_seeded(
            seed,
            lambda: nn.Sequential(
                OrderedDict(
                    sequence=nn.Unflatten(1, (1, 64)),
                    conv1=nn.Conv1d(1, 16, 5),
                    act1=nn.ReLU(),
                    conv2=nn.Conv1d(16, 32, 5),
                    act2=nn.ReLU(),
                    flat=nn.Flatten(),
                    output=nn.Linear(32 * 56, 10),
                )
            ),
        )


class SmallSynthetic(SyntheticTask):
    """The synthetic task with at most 60 samples a device, so 1,000 devices fit a short run."""

    def __init__(self) -> None:
        super().__init__(max_samples=60)


def in_run(mode: str, settings: SimulationSettings) -> tuple[float, float]:
    """(seconds, mean accuracy) of one run of `mode` in this (warm) process."""
    seconds, accuracy, _ = timed_run(mode, settings)
    return seconds, accuracy


def timed_run(mode: str, settings: SimulationSettings) -> tuple[float, float, float]:
    """`in_run`, and the seconds of it spent in `train_stacked` (`on`; NaN: not measured).

    What `on` spends outside `train_stacked` is the wire path and the engine around it: with
    none of it, `on` would take no less than the stacked bare loop.
    """
    if mode == "bare":
        return (*bare_loop(settings), math.nan)
    if mode == "stacked":
        return (*stacked_loop(settings), math.nan)
    if mode == "wire":
        return (*stacked_loop(settings, wire=True), math.nan)
    hub = InProcessBroker()
    started = time.perf_counter()
    result = run_simulation(settings.model_copy(update={"workers": 1, "batched": mode}), broker=hub)
    seconds = time.perf_counter() - started
    trainers = [getattr(hook, "__self__", None) for hook in hub.idle]
    training = next((t.stacked_seconds for t in trainers if isinstance(t, Batched)), math.nan)
    return seconds, float(result.summary["metrics"]["personalized_mean"]), training


def stacked_loop(workload: SimulationSettings, *, wire: bool = False) -> tuple[float, float]:
    """The bare loop's FedAvg with each round's local SGD as one stacked computation.

    What batching can gain with no framework around it: (seconds, mean test accuracy). With
    `wire`, each device's delta is also encoded (`pack_tensors`) and decoded under the
    receiver's checks (`unpack_tensors`: layout, checksum, finiteness) and its norm taken, as
    the guard does, before the same weighted mean: the least a path that keeps every device's
    update its own encoded, checked message can take.
    """
    task = load_task(workload.task)
    config = workload.algorithm_config()
    fleet = simulated_fleet(workload, task)
    started = time.perf_counter()
    model = task.build_model(workload.seed)
    names = tuple(name for name, _ in model.named_parameters())
    spec = TrainSpec(names, config.local_epochs, config.batch_size, config.lr)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = sum(len(d.train) for d in fleet)
    weights = torch.tensor([len(d.train) / total for d in fleet])
    for round_id in range(workload.rounds):
        members = [
            Member(d.train, torch.Generator().manual_seed(round_id), global_state, global_state)
            for d in fleet
        ]
        trained = train_stacked(model, task, members, (BatchPhase(spec),))
        if wire:  # the manifest entries the coordinator expects of each update
            expected = describe_tensors(global_state)
            trained = [_over_the_wire(t, global_state, expected) for t in trained]
        global_state = {
            k: v
            + torch.einsum("d,d...->...", weights, torch.stack([t.final[k] for t in trained]) - v)
            for k, v in global_state.items()
        }
    model.load_state_dict(global_state)
    return time.perf_counter() - started, mean_test_metric(model, task, fleet)


def _over_the_wire(trained: Trained, received: Tensors, expected: Sequence[TensorSpec]) -> Trained:
    """`trained` with its final tensors rebuilt from its delta as encoded, decoded and checked."""
    manifest, blob = pack_tensors(difference(trained.final, received))
    delta = unpack_tensors(manifest, blob, expected=expected)
    update_norm(delta)
    final = {name: received[name] + delta[name] for name in received}
    return Trained(final, trained.stats, trained.kept)


def whole_process(mode: str, workload: str) -> float:
    """Seconds of a fresh interpreter running `mode` once, imports included."""
    code = (
        "import sys; from benchmarks.batched_overhead import in_run, settings; "
        "in_run(sys.argv[1], settings(sys.argv[2]))"
    )
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, mode, workload], check=True)
    return time.perf_counter() - started


def settings(workload: str = next(iter(WORKLOADS))) -> SimulationSettings:
    """A workload's settings (no run files written)."""
    return SimulationSettings.load(None, **WORKLOADS[workload])


def measure(workload: str, repeats: int) -> dict[str, dict[str, float]]:
    """Median in-run and whole-process seconds, and accuracy, per mode; alternating."""
    chosen = settings(workload)
    for mode in MODES:  # warm-up: imports, data set, allocator
        in_run(mode, chosen)
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    training: dict[str, list[float]] = {mode: [] for mode in MODES}
    whole: dict[str, list[float]] = {mode: [] for mode in MODES}
    accuracy: dict[str, float] = {}
    for _ in range(repeats):
        for mode in MODES:
            seconds, accuracy[mode], stacked = timed_run(mode, chosen)
            runs[mode].append(seconds)
            training[mode].append(stacked)
            whole[mode].append(whole_process(mode, workload))
    return {
        mode: {
            "in_run": statistics.median(runs[mode]),
            "training": statistics.median(training[mode]),
            "whole": statistics.median(whole[mode]),
            "accuracy": accuracy[mode],
        }
        for mode in MODES
    }


def step_macs(workload: SimulationSettings) -> int:
    """`largest_step_macs` of the workload's model and fleet: what `--batched auto` compares."""
    task = load_task(workload.task, workload.task_options)
    fleet = simulated_fleet(workload, task)
    inputs = [d.train.inputs for d in fleet]
    batch_size = workload.algorithm_config().batch_size
    return largest_step_macs(task.build_model(workload.seed), inputs, batch_size)


def machine(repeats: int, load: float) -> str:
    """The line every table states its machine and repeats in."""
    return (
        f"Machine: {platform.machine()}, {available_cores()} cores shared with other jobs "
        f"(load average {load:.1f} at the start); torch {torch.__version__}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; median of "
        f"{repeats} alternating repeats."
    )


NAMES = {
    "bare": "bare PyTorch loop",
    "stacked": "bare loop, local SGD stacked (`train_stacked`)",
    "wire": "the same, each update encoded and checked (`pack_tensors`, `unpack_tensors`)",
    "off": "simulate --batched off",
    "on": "simulate --batched on",
}


def overhead_table(repeats: int) -> str:
    """Every workload's rows."""
    load = os.getloadavg()[0]
    rows = []
    for name in WORKLOADS:
        result = measure(name, repeats)
        bare = result["bare"]
        macs = step_macs(settings(name))
        rows += [
            f"| {name} ({macs:,} multiply-adds a step) | {NAMES[mode]} | {r['in_run']:.2f} | "
            f"{_seconds(r['training'])} | {bare['in_run'] / r['in_run']:.2f}x | "
            f"{r['whole']:.2f} | {bare['whole'] / r['whole']:.2f}x | {r['accuracy']:.3f} |"
            for mode, r in result.items()
        ]
        print("\n".join(rows[-len(MODES) :]), flush=True)
    return "\n".join(
        [
            MARKER,
            "## Batched local training against per-device and a bare loop",
            "",
            "Workloads: FedAvg, local_epochs=1, dirichlet alpha=0.5, seed 0, batch size 10; the "
            "1-D CNN is `benchmarks.batched_overhead:ConvDigits` (two Conv1d layers and a linear "
            "read-out, 20,426 parameters), the 1,000 devices `SmallSynthetic` (the synthetic "
            "task's MLP, at most 60 samples a device). One worker (every device in one process). "
            "In-run: the run alone in a warm process; whole process: a fresh `python` from its "
            "first import. Speed-up is against the bare loop of the same workload. In "
            "`train_stacked`: the part of `--batched on`'s in-run time spent in the stacked "
            "step; the rest is the per-device wire path and the engine around it.",
            machine(repeats, load),
            "",
            "| workload | path | in-run (s) | in `train_stacked` (s) | speed-up | "
            "whole process (s) | speed-up | mean accuracy |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Command: `OMP_NUM_THREADS=1 nice python -m benchmarks.batched_overhead "
            f"--repeats {repeats}`.",
            MARKER,
        ]
    )


def _seconds(value: float) -> str:
    """A cell of seconds ("-" where not measured)."""
    return "-" if math.isnan(value) else f"{value:.2f}"


def threshold_table(repeats: int) -> str:
    """`--batched on` against `off` by hidden width of the digits MLP, with the step's cost."""
    load = os.getloadavg()[0]
    rows = []
    for hidden in (64, 256, 512, 1024, 2048):
        workload = SimulationSettings.load(
            None, **{**WORKLOAD, "devices": 50, "rounds": 3, "task_options": {"hidden": hidden}}
        )
        times: dict[str, list[float]] = {"off": [], "on": []}
        for mode in times:
            in_run(mode, workload)  # warm-up
        for _ in range(repeats):
            for mode, kept in times.items():
                kept.append(in_run(mode, workload)[0])
        off, on = (statistics.median(times[mode]) for mode in ("off", "on"))
        rows.append(
            f"| {hidden} | {step_macs(workload):,} | {off:.2f} | {on:.2f} | {off / on:.2f}x |"
        )
        print(rows[-1], flush=True)
    return "\n".join(
        [
            THRESHOLD_MARKER,
            "### Where batching pays: `--batched on` against `off` by step cost",
            "",
            "The digits MLP by hidden width; FedAvg, 50 devices, 3 rounds, one worker, in-run.",
            machine(repeats, load),
            "",
            "| hidden width | multiply-adds a step | off (s) | on (s) | speed-up of on |",
            "|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Command: `OMP_NUM_THREADS=1 nice python -m benchmarks.batched_overhead --threshold "
            f"--repeats {repeats}`.",
            THRESHOLD_MARKER,
        ]
    )


def checkout_seconds(root: Path, mode: str, runs: int) -> float:
    """Median in-run seconds of `mode` on the digits MLP in a fresh interpreter of `root`'s code.

    One warm-up run first, as in `measure`.
    """
    code = (
        "import statistics, sys; from benchmarks.batched_overhead import in_run, settings; "
        "s = settings(); in_run(sys.argv[1], s); "
        "print(statistics.median(in_run(sys.argv[1], s)[0] for _ in range(int(sys.argv[2]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, mode, str(runs)],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root.resolve())},
    )
    return float(done.stdout.strip().splitlines()[-1])


def before_after_table(before: Path, repeats: int) -> str:
    """`--batched on`/`off` and the bare loop in-run, this checkout against `before`."""
    load = os.getloadavg()[0]
    here = Path(__file__).resolve().parent.parent
    roots = {"before": before, "after": here}
    modes = ("bare", "off", "on")
    times: dict[tuple[str, str], list[float]] = {(r, m): [] for r in roots for m in modes}
    for _ in range(repeats):
        for mode in modes:
            for name, root in roots.items():
                times[name, mode].append(checkout_seconds(root, mode, 3))
    median = {key: statistics.median(kept) for key, kept in times.items()}
    rows = [
        f"| {name} ({commit_of(root)}) | "
        + " | ".join(f"{median[name, mode]:.2f}" for mode in modes)
        + f" | {median[name, 'bare'] / median[name, 'on']:.2f}x |"
        for name, root in roots.items()
    ]
    return "\n".join(
        [
            WIRE_MARKER,
            "### The wire path around the stacked step, before and after",
            "",
            "Digits MLP, FedAvg, 50 devices, 20 rounds, one worker, in-run; each cell the median "
            "of its fresh interpreters (each: one warm-up run, then the median of 3), checkouts "
            "and modes alternating.",
            machine(repeats, load),
            "",
            "| checkout | bare loop (s) | --batched off (s) | --batched on (s) | "
            "on against the bare loop |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
            f"Command: `OMP_NUM_THREADS=1 nice python -m benchmarks.batched_overhead "
            f"--before-root DIR --repeats {repeats}` (DIR: a checkout of the code before).",
            WIRE_MARKER,
        ]
    )


def commit_of(root: Path) -> str:
    """The checkout's short commit."""
    git = ["git", "-C", str(root), "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    """Measure and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threshold", action="store_true")
    parser.add_argument("--before-root", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    if args.threshold:
        write_section(args.out, threshold_table(args.repeats), THRESHOLD_MARKER)
    elif args.before_root is not None:
        write_section(args.out, before_after_table(args.before_root, args.repeats), WIRE_MARKER)
    else:
        write_section(args.out, overhead_table(args.repeats), MARKER)


if __name__ == "__main__":
    main()
