"""Peak resident memory of one local update under memory budgets, against the plan.

Each measurement runs in a fresh process: build a ~5M-parameter MLP and a 2048-sample batch,
reset the kernel's peak counter (write 5 to /proc/self/clear_refs), plan with the budget, run one
local update with the planned micro-batch, and read the peak back (VmHWM). Budgets are the
runtime's baseline plus 1, 1/2 and 1/4 of the unconstrained update's increment over it.

    python -m benchmarks.memory [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from benchmarks.simulation_overhead import write_section
from device_agent.memory_plan import memory_model, plan_training
from device_agent.training import StepBudget, TrainSpec, difference, snapshot, train
from protocols.codec import pack_tensors
from protocols.errors import MemoryBudgetError
from tasks.base import Split
from tasks.models import classification_loss, count_correct
from tasks.split import ParamSplit

MARKER = "<!-- memory-budget -->"
BATCH = 2048
WIDTH = 2048
INPUTS = 512


class _WideTask:
    name = "wide-mlp"
    metric_name = "accuracy"
    personal_patterns = ("output.*",)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return classification_loss(outputs, targets)

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        return count_correct(outputs, targets)


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    msg = "VmHWM not found: peak memory needs Linux /proc"
    raise RuntimeError(msg)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def child(fraction: float | None, increment: int) -> dict[str, object]:
    """One measurement in this (fresh) process."""
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            hidden=nn.Linear(INPUTS, WIDTH), act=nn.ReLU(), hidden2=nn.Linear(WIDTH, WIDTH),
            act2=nn.ReLU(), output=nn.Linear(WIDTH, 10),
        )
    )  # fmt: skip
    data = Split(torch.randn(BATCH, INPUTS), torch.randint(0, 10, (BATCH,)))
    task = _WideTask()
    split = ParamSplit.for_model(model, ())
    names = tuple(n for n, _ in model.named_parameters())
    terms = memory_model(model, task, data, split)  # probes: afterwards the runtime is warm
    baseline = _rss_kib() * 1024
    terms = dataclasses.replace(terms, runtime_bytes=baseline)
    budget = None if fraction is None else baseline + int(fraction * increment)
    result: dict[str, object] = {"fraction": fraction, "baseline": baseline, "budget": budget}
    try:
        plan = plan_training(terms, budget, BATCH) if budget is not None else None
    except MemoryBudgetError as error:
        result["refused"] = str(error)
        return result
    Path("/proc/self/clear_refs").write_text("5")
    spec = TrainSpec(trainable=names, epochs=1, batch_size=BATCH, lr=0.01)
    micro = plan.micro_batch_size if plan is not None else None
    # what an agent's round holds: the broadcast copy, training, then the delta and its encoding
    broadcast = snapshot(model, split.shared)
    train(model, task, data, spec, torch.Generator().manual_seed(0), budget=StepBudget(micro))
    pack_tensors(difference(snapshot(model, split.shared), broadcast))
    result.update(
        micro_batch=micro or BATCH,
        estimated_peak=plan.estimated_peak_bytes if plan is not None else terms.peak(BATCH),
        peak=_peak_kib() * 1024,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return result


def measure(fraction: float | None, increment: int) -> dict[str, object]:
    """Run `child` in a fresh interpreter, so peaks do not carry over."""
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--child", json.dumps([fraction, increment])],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    """Measure and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        fraction, increment = json.loads(args.child)
        print(json.dumps(child(fraction, increment)))
        return
    free = measure(None, 0)
    increment = int(free["peak"]) - int(free["baseline"])
    mib = 2**20
    rows = [
        "| budget | budget (MiB) | micro-batch | planned peak (MiB) | measured peak (MiB) "
        "| measured / budget |",
        "|---|---:|---:|---:|---:|---:|",
        f"| none (batch {BATCH}) | - | {BATCH} | {int(free['estimated_peak']) / mib:.0f} | "
        f"{int(free['peak']) / mib:.0f} | - |",
    ]
    for fraction in (1.0, 0.75, 0.5, 0.25):
        run = measure(fraction, increment)
        budget = int(run["budget"]) / mib
        label = f"baseline + {fraction:g} x increment"
        if "refused" in run:
            rows.append(
                f"| {label} | {budget:.0f} | refused: needs more than the budget | - | - | - |"
            )
            continue
        rows.append(
            f"| {label} | {budget:.0f} | {run['micro_batch']} | "
            f"{int(run['estimated_peak']) / mib:.0f} | {int(run['peak']) / mib:.0f} | "
            f"{int(run['peak']) / mib / budget:.2f} |"
        )
    section = "\n".join(
        [
            MARKER,
            "## Peak memory of one local update under a budget",
            "",
            f"An MLP {INPUTS}-{WIDTH}-{WIDTH}-10 ({int(free['parameters']):,} parameters), one SGD "
            f"step on a batch of {BATCH}; runtime baseline {int(free['baseline']) / mib:.0f} MiB, "
            f"unconstrained increment {increment / mib:.0f} MiB. Peak = VmHWM of a fresh process.",
            "",
            *rows,
            "",
            "Command: `python -m benchmarks.memory`.",
            MARKER,
        ]
    )
    write_section(args.out, section, MARKER)
    print(section)


if __name__ == "__main__":
    main()
