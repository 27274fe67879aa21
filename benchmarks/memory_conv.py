"""Memory-aware training of a 1-D CNN and a GRU under budgets: the plan, the peak, the speed.

For each model and budget a fresh process builds the model and a batch of random signals, plans
with `memory_model` + `plan_training` (probing as an agent does), then trains `STEPS` SGD steps
on batches of `BATCH` with the plan's micro-batch and checkpointing. Peak = VmHWM of that
process (the kernel's peak resident set, reset by writing 5 to /proc/self/clear_refs after the
imports, the data and the probes), so it includes the Python and torch runtime, as a budget does.
Every process runs one torch thread.

    python -m benchmarks.memory_conv [--out docs/benchmarks.md] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Final

import torch
from torch import nn

from benchmarks.common import publish_section
from benchmarks.memory import status_kib
from device_agent.memory_plan import MemoryModel, memory_model, plan_training
from device_agent.training import StepBudget, TrainSpec, train
from pfl_tasks.base import DeviceData, PartitionSpec, Split
from pfl_tasks.models import Classification, build_seeded
from pfl_tasks.split import ParamSplit
from protocols.errors import MemoryBudgetError

MARKER: Final = "<!-- memory-conv -->"
LENGTH: Final = 96
CHANNELS: Final = 32
WIDTH: Final = 128
HIDDEN: Final = 128
CLASSES: Final = 10
BATCH: Final = 512
STEPS: Final = 6
BUDGETS: Final = (None, 1_000_000_000, 512_000_000, 256_000_000)
MODELS: Final = ("cnn", "gru")


def conv_block(inputs: int, width: int = WIDTH, outputs: int = CHANNELS) -> nn.Sequential:
    """Expand and project (as in MobileNet): Conv1d k=5 to `width`, then k=1 to `outputs`.

    Each convolution is followed by BatchNorm and ReLU; the block's internals are wider than
    its input and output, which is where checkpointing saves memory.
    """
    return nn.Sequential(
        nn.Conv1d(inputs, width, kernel_size=5, padding=2),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Conv1d(width, outputs, kernel_size=1),
        nn.BatchNorm1d(outputs),
        nn.ReLU(),
    )


def cnn1d() -> nn.Sequential:
    """Three conv blocks and a pooled linear head over (batch, 1, length): four top-level blocks."""
    return nn.Sequential(
        conv_block(1),
        conv_block(CHANNELS),
        conv_block(CHANNELS),
        nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(CHANNELS, CLASSES)),
    )


class GruClassifier(nn.Module):
    """A one-layer GRU over (batch, length, 1) signals; its last hidden state is classified."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.output = nn.Linear(hidden, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits from the last time step."""
        states, _ = self.gru(inputs)
        logits: torch.Tensor = self.output(states[:, -1])
        return logits


class SignalTask(Classification):
    """Signal classification for the benchmark; it makes its own data, so there is no fleet."""

    name: ClassVar[str] = "signals"
    personal_patterns: tuple[str, ...] = ()
    input_names: tuple[str, ...] = ("signals",)
    output_names: tuple[str, ...] = ("logits",)

    def __init__(self, model: str) -> None:
        self.model = model

    def build_model(self, seed: int) -> nn.Module:
        """The 1-D CNN or the GRU."""
        return build_seeded(seed, cnn1d if self.model == "cnn" else GruClassifier)

    def signals(self, count: int, seed: int = 0) -> Split:
        """`count` random signals shaped for the model, with random labels."""
        generator = torch.Generator().manual_seed(seed)
        shape = (count, 1, LENGTH) if self.model == "cnn" else (count, LENGTH, 1)
        return Split(
            torch.randn(shape, generator=generator),
            torch.randint(0, CLASSES, (count,), generator=generator),
        )

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """None: the benchmark and its tests make their own signals (`signals`)."""
        msg = "the benchmark makes its own data"
        raise NotImplementedError(msg)


def forced(terms: MemoryModel, lever: str) -> MemoryModel:
    """`terms` as the plan sees them when one lever is forced ("plan": as measured).

    "micro": no blocks to checkpoint; "checkpoint": plain training would not fit one sample.
    """
    if lever == "micro":
        return dataclasses.replace(terms, checkpointed_bytes_per_sample=None)
    if lever == "checkpoint":
        return dataclasses.replace(terms, activation_bytes_per_sample=2**50)
    return terms


def child(
    model_name: str, budget: int | None, steps: int, batch: int = BATCH, lever: str = "plan"
) -> dict[str, Any]:
    """Plan and train in this (fresh) process; the plan, peak and speed as JSON-able values."""
    torch.set_num_threads(1)
    task = SignalTask(model_name)
    model = task.build_model(0)
    data = task.signals(batch * steps)
    terms = memory_model(model, task, data, ParamSplit.for_model(model, ()))
    terms = dataclasses.replace(terms, runtime_bytes=1024 * status_kib("VmRSS"))
    result: dict[str, Any] = {
        "model": model_name,
        "budget": budget,
        "runtime": terms.runtime_bytes,
        "per_sample": terms.per_sample(checkpointing=False),
        "checkpointed_per_sample": terms.checkpointed_bytes_per_sample,
        "parameters": sum(p.numel() for p in model.parameters()),
        "method": terms.method,
        "lever": lever,
    }
    try:
        plan = None if budget is None else plan_training(forced(terms, lever), budget, batch)
    except MemoryBudgetError as error:
        return {**result, "refused": str(error)}
    budget_of_step = (
        StepBudget()
        if plan is None
        else StepBudget(plan.micro_batch_size, checkpointing=plan.checkpointing)
    )
    spec = TrainSpec(
        trainable=tuple(name for name, _ in model.named_parameters()),
        epochs=1,
        batch_size=batch,
        lr=0.01,
    )
    Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    stats = train(model, task, data, spec, torch.Generator().manual_seed(0), budget=budget_of_step)
    seconds = time.perf_counter() - started
    return {
        **result,
        "micro_batch": batch if plan is None else plan.micro_batch_size,
        "checkpointing": plan is not None and plan.checkpointing,
        "planned_peak": terms.peak(batch) if plan is None else plan.estimated_peak_bytes,
        "peak": 1024 * status_kib("VmHWM"),
        "steps_per_second": stats.steps / seconds,
    }


def measure(
    model_name: str, budget: int | None, steps: int, batch: int = BATCH, lever: str = "plan"
) -> dict[str, Any]:
    """`child` in a fresh interpreter, so no peak or allocator state carries over."""
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_conv", "--child",
         json.dumps([model_name, budget, steps, batch, lever])],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    measured: dict[str, Any] = json.loads(output.stdout.strip().splitlines()[-1])
    return measured


def _row(run: dict[str, Any]) -> str:
    mib = 2**20
    budget = "none" if run["budget"] is None else f"{run['budget'] / 10**6:.0f} MB"
    if "refused" in run:
        needs = run["refused"].split("it needs ", 1)[1].split(" (runtime")[0]
        return f"| {run['model']} | {budget} | refused: needs {needs} | - | - | - | - |"
    choice = f"micro-batch {run['micro_batch']} x {-(-BATCH // int(run['micro_batch']))}"
    if run["checkpointing"]:
        choice += ", checkpointing"
    if run["lever"] != "plan":
        choice = f"({choice}: {run['lever']} forced)"
    within = "-" if run["budget"] is None else f"{run['peak'] / run['budget']:.2f}"
    return (
        f"| {run['model']} | {budget} | {choice} | {run['planned_peak'] / mib:.0f} | "
        f"{run['peak'] / mib:.0f} | {within} | {run['steps_per_second']:.2f} |"
    )


def section(steps: int) -> list[str]:
    """Measure every model at every budget; the section's lines."""
    runs = []
    for name in MODELS:
        for budget in BUDGETS:
            run = measure(name, budget, steps)
            runs.append(run)
            if run.get("micro_batch", BATCH) < BATCH or run.get("checkpointing"):
                other = "micro" if run["checkpointing"] else "checkpoint"
                if other == "micro" or run["checkpointed_per_sample"] is not None:
                    runs.append(measure(name, budget, steps, lever=other))
    mib = 2**20
    described = []
    for name in MODELS:
        first = next(run for run in runs if run["model"] == name)
        checkpointed = first["checkpointed_per_sample"]
        described.append(
            f"{name}: {first['parameters']:,} parameters, activations "
            f"{first['per_sample'] / 1024:.0f} KiB a sample"
            + (
                f", {checkpointed / 1024:.0f} KiB checkpointed"
                if checkpointed is not None
                else " (no blocks to checkpoint)"
            )
            + f" ({first['method']}), runtime {first['runtime'] / mib:.0f} MiB"
        )
    return [
        "## Memory-aware training of a 1-D CNN and a GRU",
        "",
        f"The 1-D CNN: three blocks of Conv1d k=5 to {WIDTH} channels, BatchNorm, ReLU, Conv1d "
        f"k=1 to {CHANNELS} channels, BatchNorm, ReLU over signals of length {LENGTH}, then "
        "average pooling and a linear head (`benchmarks/memory_conv.py`); the GRU: one layer of "
        f"{HIDDEN} units over the same signals, its last state classified. {steps} SGD steps on "
        f"batches of {BATCH}, one torch thread, each row a fresh process. Budgets are in MB "
        "(10^6 bytes) and include the process's runtime; peak = VmHWM of the process. "
        + "; ".join(described)
        + ". Rows in parentheses force the lever the plan did not take, at the same budget.",
        "",
        "| model | budget | plan | planned peak (MiB) | measured peak (MiB) "
        "| peak / budget | steps/s |",
        "|---|---|---|---:|---:|---:|---:|",
        *(_row(run) for run in runs),
        "",
        "Command: `python -m benchmarks.memory_conv`.",
    ]


def main() -> None:
    """Measure and write the table, or run one measurement (--child)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(*json.loads(args.child))))
        return
    publish_section(args.out, MARKER, section(args.steps))


if __name__ == "__main__":
    main()
