"""pfl-edge beside its peers (Flower, Apple's pfl) and a bare loop, from one command.

The harness writes each workload's data and model once (`benchmarks.peers.common`), makes or
reuses one virtual environment per peer (`benchmarks.peers_venvs`), then runs every runner as a
fresh process, runners alternating within each repeat: whole-process time is the parent's
clock from start to exit, in-run time the runner's own `RoundClock` (round 1's start to the last
round's end). Medians of the repeats; each runner reports its framework's version.

    OMP_NUM_THREADS=1 nice python -m benchmarks.peers --venvs /tmp/peer-venvs
        [--repeats 3] [--workloads digits-mlp,mnist1d-cnn,synthetic-1000]
        [--runners bare,edge-batched,edge-per-device,edge-default,flower,pfl] [--no-install]
        [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from benchmarks.common import choose, write_section
from benchmarks.peers import common
from benchmarks.peers_venvs import PEERS, ROOT, peer_python, project_python
from coordinator.run.settings import SimulationSettings
from device_agent.compute_threads import available_cores
from pfl_tasks.registry import load_task

logger = logging.getLogger(__name__)
MARKER: Final = "<!-- peer-comparison -->"
BASE: Final[dict[str, Any]] = {
    "algorithm": "fedavg",
    "local_epochs": 1,
    "seed": 0,
}
WORKLOADS: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    "digits-mlp": (
        "digits MLP",
        {**BASE, "task": "digits", "devices": 50, "rounds": 20, "partition": "dirichlet"},
    ),
    "mnist1d-cnn": (
        "MNIST-1D 1-D CNN",
        {**BASE, "task": "mnist1d", "devices": 50, "rounds": 10, "partition": "iid"},
    ),
    "synthetic-1000": (
        "synthetic MLP",
        {
            **BASE,
            "task": "synthetic",
            "task_options": {"max_samples": 60},
            "devices": 1000,
            "rounds": 2,
            "partition": "iid",
        },
    ),
}


@dataclass(frozen=True)
class Runner:
    """One row: which runner module, in which environment, with which options."""

    label: str
    module: str
    peer: str | None = None
    options: tuple[str, ...] = ()


RUNNERS: Final = {
    "bare": Runner("bare PyTorch loop", "benchmarks.peers.bare"),
    "edge-batched": Runner(
        "pfl-edge `simulate --batched on --workers 1`",
        "benchmarks.peers.edge",
        options=("batched=on", "workers=1"),
    ),
    "edge-per-device": Runner(
        "pfl-edge `simulate --batched off --workers 1`",
        "benchmarks.peers.edge",
        options=("batched=off", "workers=1"),
    ),
    "edge-default": Runner(
        "pfl-edge `simulate` (defaults: batched auto, a worker per core)",
        "benchmarks.peers.edge",
        options=("batched=auto", "workers=0"),
    ),
    **{name: Runner(peer.label, peer.module, peer=name) for name, peer in PEERS.items()},
}
REFERENCE: Final = "edge-default"


def layers_of(model: nn.Module) -> list[tuple[str, str, dict[str, Any]]]:
    """The model as `common.LAYERS` entries: (class name, module name, constructor arguments).

    Raises:
        ValueError: the model is not an nn.Sequential of layers `common` can build.
    """
    described: list[tuple[str, str, dict[str, Any]]] = []
    if not isinstance(model, nn.Sequential):
        msg = f"the peers build nn.Sequential models; this one is a {type(model).__name__}"
        raise ValueError(msg)
    for name, layer in model.named_children():
        kind = type(layer).__name__
        arguments: dict[str, Any]
        if isinstance(layer, nn.Linear):
            arguments = {"in_features": layer.in_features, "out_features": layer.out_features}
        elif isinstance(layer, nn.Conv1d):
            arguments = {
                "in_channels": layer.in_channels,
                "out_channels": layer.out_channels,
                "kernel_size": layer.kernel_size[0],
                "stride": layer.stride[0],
                "padding": layer.padding[0] if isinstance(layer.padding, tuple) else 0,
            }
        elif isinstance(layer, nn.GroupNorm):
            arguments = {"num_groups": layer.num_groups, "num_channels": layer.num_channels}
        elif isinstance(layer, nn.MaxPool1d):
            arguments = {"kernel_size": layer.kernel_size}
        elif isinstance(layer, nn.Unflatten):
            arguments = {"dim": layer.dim, "unflattened_size": list(layer.unflattened_size)}
        elif isinstance(layer, nn.Flatten | nn.ReLU):
            arguments = {}
        else:
            msg = f"layer {name!r} ({kind}) is not one the peers can build"
            raise ValueError(msg)
        described.append((kind, name, arguments))
    return described


def write_workload(directory: Path, simulation: dict[str, Any]) -> common.Workload:
    """The workload's files, from the task pfl-edge simulates, checked by reading them back.

    Raises:
        ValueError: the standalone model read back does not compute what the task's model does.
    """
    settings = SimulationSettings.load(None, **simulation)
    task = load_task(settings.task, settings.task_options)
    config = settings.algorithm_config()
    model = task.build_model(settings.seed)
    fleet = task.make_fleet(settings.devices, settings.partition_spec(), settings.seed)
    arrays: dict[str, Any] = {f"init_{k}": v.numpy() for k, v in model.state_dict().items()}
    for i, device in enumerate(fleet):
        arrays |= {
            f"train_x_{i}": device.train.inputs.numpy(),
            f"train_y_{i}": device.train.targets.numpy(),
            f"test_x_{i}": device.test.inputs.numpy(),
            f"test_y_{i}": device.test.targets.numpy(),
        }
    described = {
        "settings": {
            "devices": settings.devices,
            "rounds": settings.rounds,
            "local_epochs": config.local_epochs,
            "batch_size": config.batch_size,
            "lr": config.lr,
            "simulation": simulation,
        },
        "layers": layers_of(model),
        "state": list(model.state_dict()),
    }
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "workload.npz", **arrays)
    (directory / "workload.json").write_text(json.dumps(described, indent=1))
    workload = common.load_workload(directory)
    probe = fleet[0].test.inputs
    with torch.no_grad():
        if not torch.equal(workload.build_model()(probe), model(probe)):
            msg = f"the standalone model of {settings.task} computes other outputs than the task's"
            raise ValueError(msg)
    return workload


@dataclass
class Timings:
    """One runner's runs on one workload."""

    whole_s: list[float] = field(default_factory=list)
    in_run_s: list[float] = field(default_factory=list)
    accuracy: float = float("nan")
    versions: dict[str, str] = field(default_factory=dict)
    failure: str | None = None


def run_once(
    python: Path, runner: Runner, directory: Path, threads: int, log: Path, timeout_s: float
) -> dict[str, Any]:
    """One fresh process of `runner` on the workload in `directory`: its result and whole time.

    Raises:
        RuntimeError: the runner failed or timed out (the tail of its log).
    """
    result = directory / f"result-{os.getpid()}.json"
    result.unlink(missing_ok=True)
    command = [str(python), "-m", runner.module, "--workload", str(directory)]
    command += ["--result", str(result), "--threads", str(threads)]
    command += [item for option in runner.options for item in ("--option", option)]
    # the runner modules are found through the checkout; a peer's venv holds none of pfl-edge
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    with log.open("ab") as sink:
        # a session of its own: a run out of time is stopped with every process it started
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=sink, stderr=sink, start_new_session=True
        )
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            msg = f"did not finish within {timeout_s:g} s"
            raise RuntimeError(msg) from None
    whole = time.perf_counter() - started
    if status != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        msg = f"exit status {status}: " + " / ".join(tail)
        raise RuntimeError(msg)
    document: dict[str, Any] = json.loads(result.read_text())
    return {**document, "whole_s": whole}


def measure(
    directory: Path,
    runners: Mapping[str, Runner],
    pythons: dict[str, Path],
    repeats: int,
    threads: int,
    timeout_s: float,
) -> dict[str, Timings]:
    """Every runner `repeats` times on one workload, alternating; a failed runner stops there."""
    timings = {name: Timings() for name in runners}
    for repeat in range(repeats):
        for name in runners:
            kept = timings[name]
            if kept.failure is not None:
                continue
            log = directory / f"{name}.log"
            try:
                run = run_once(pythons[name], runners[name], directory, threads, log, timeout_s)
            except RuntimeError as error:
                kept.failure = str(error)
                logger.warning("%s failed: %s", name, error)
                continue
            kept.whole_s.append(run["whole_s"])
            kept.in_run_s.append(run["in_run_s"])
            kept.accuracy, kept.versions = run["accuracy"], run["versions"]
            logger.info(
                "%s, repeat %d: whole %.2f s, in-run %.2f s, accuracy %.3f",
                name,
                repeat + 1,
                run["whole_s"],
                run["in_run_s"],
                run["accuracy"],
            )
    return timings


def version_cell(name: str, versions: dict[str, str]) -> str:
    """The row's framework and its version (torch and Python are stated once, above)."""
    shown = {k: v for k, v in versions.items() if k not in ("torch", "python")}
    if not shown:
        return "torch " + versions.get("torch", "?") if name == "bare" else "?"
    return ", ".join(f"{k} {v}" for k, v in shown.items())


def reference_of(timings: dict[str, Timings]) -> str | None:
    """The row the others are compared with: pfl-edge's default, else the bare loop, if run."""
    done = [name for name, t in timings.items() if t.failure is None and t.in_run_s]
    return next((name for name in (REFERENCE, "bare") if name in done), None)


def rows(timings: dict[str, Timings]) -> list[str]:
    """The workload's rows: medians, each against `reference_of`'s."""
    reference = reference_of(timings)
    lines = []
    for name, kept in timings.items():
        if kept.failure is not None or not kept.in_run_s:
            lines.append(f"| {RUNNERS[name].label} | | failed: {kept.failure} | | | | | |")
            continue
        in_run, whole = statistics.median(kept.in_run_s), statistics.median(kept.whole_s)
        ratio_in, ratio_whole = "", ""
        if reference is not None:
            base = timings[reference]
            ratio_in = f"{in_run / statistics.median(base.in_run_s):.2f}x"
            ratio_whole = f"{whole / statistics.median(base.whole_s):.2f}x"
        lines.append(
            f"| {RUNNERS[name].label} | {version_cell(name, kept.versions)} | {in_run:.2f} | "
            f"{ratio_in} | {whole:.2f} | {ratio_whole} | {kept.accuracy:.3f} | "
            f"{len(kept.in_run_s)} |"
        )
    return lines


def section(
    results: dict[str, dict[str, Timings]], loads: tuple[float, float], command: str
) -> str:
    """The doc's section: one table per workload (`results` by title), the machine, the command."""
    versions = {
        (t.versions.get("torch"), t.versions.get("python"))
        for by_runner in results.values()
        for t in by_runner.values()
        if t.versions
    }
    shared = "; ".join(f"torch {torch_v}, Python {python_v}" for torch_v, python_v in versions)
    lines = [
        MARKER,
        "## Side by side with peer frameworks: Flower, Apple's pfl, a bare loop",
        "",
        "FedAvg, every device every round, 1 local epoch, batch size and learning rate the "
        "task's defaults; each framework trains the same model from the same initial weights on "
        "the same devices' data (written once by the harness), in the same minibatch order "
        "where the framework lets its caller choose it (all but pfl-edge, whose agents draw "
        "their own). In-run: from round 1's start to the last round's end, taken inside each "
        "run the same way; whole process: a fresh interpreter from start to exit, imports, "
        "data loading and the final evaluation included. Each cell is the median of the "
        "repeats (runs alternate); 'against' divides a time by the reference row's (named "
        "under each table; above 1x: slower).",
        f"Machine: {platform.machine()}, {available_cores()} cores shared with other jobs (load "
        f"average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end); {shared} in every "
        f"environment; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; pfl-edge "
        f"at commit {commit()}.",
    ]
    for name, by_runner in results.items():
        reference = reference_of(by_runner)
        lines += [
            "",
            f"**{name}**",
            "",
            "| run | version | in-run (s) | against | whole process (s) | against | mean test "
            "accuracy | runs |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
            *rows(by_runner),
            "",
            f"Reference: {RUNNERS[reference].label if reference else 'none (no run finished)'}.",
        ]
    lines += ["", f"Command: `{command}`.", MARKER]
    return "\n".join(lines)


def commit() -> str:
    """The checkout's short commit (pfl-edge's rows run this code)."""
    git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip() or "?"


def workload_settings(name: str, devices: int | None, rounds: int | None) -> dict[str, Any]:
    """A workload's simulation settings, with the command line's overrides."""
    simulation = dict(WORKLOADS[name][1])
    if devices is not None:
        simulation["devices"] = devices
    if rounds is not None:
        simulation["rounds"] = rounds
    return simulation


def main(argv: Sequence[str] | None = None) -> None:
    """Build the environments, run every runner on every workload, write the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "peer-venvs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=None, help="comma-separated; default: all")
    parser.add_argument("--runners", default=None, help="comma-separated; default: all")
    parser.add_argument("--devices", type=int, default=None, help="override every workload's")
    parser.add_argument("--rounds", type=int, default=None, help="override every workload's")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each runner")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    parser.add_argument("--no-install", action="store_true", help="use existing venvs only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workloads = choose(args.workloads, list(WORKLOADS), "workload")
    runners = choose(args.runners, list(RUNNERS), "runner")
    pythons, unavailable = {}, {}
    for name in runners:
        peer = RUNNERS[name].peer
        try:
            pythons[name] = (
                project_python()
                if peer is None
                else peer_python(args.venvs, peer, install=not args.no_install)
            )
        except RuntimeError as error:
            unavailable[name] = str(error)
            logger.warning("%s: %s", name, error)
    loads_start = os.getloadavg()[0]
    results: dict[str, dict[str, Timings]] = {}
    for name in workloads:
        directory = args.venvs / "workloads" / name
        simulation = workload_settings(name, args.devices, args.rounds)
        write_workload(directory, simulation)
        ready = {runner: RUNNERS[runner] for runner in runners if runner in pythons}
        title = (
            f"{WORKLOADS[name][0]}, {simulation['devices']:,} devices, "
            f"{simulation['rounds']} rounds"
        )
        results[title] = measure(
            directory, ready, pythons, args.repeats, args.threads, args.timeout
        )
        for runner, reason in unavailable.items():
            results[title][runner] = Timings(failure=reason)
    given = list(argv) if argv is not None else sys.argv[1:]
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = [f"OMP_NUM_THREADS={threads}"] if threads else []
    prefix += ["nice"] if os.nice(0) > 0 else []
    command = " ".join([*prefix, "python -m benchmarks.peers", *given])
    text = section(results, (loads_start, os.getloadavg()[0]), command)
    write_section(args.out, text, MARKER)
    print(text)


if __name__ == "__main__":
    main()
