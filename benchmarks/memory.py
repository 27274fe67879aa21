"""Peak resident memory of one local update: under memory budgets, and by personalization mode.

Each measurement runs in a fresh process and reads the kernel's peak counter (reset by writing 5
to /proc/self/clear_refs, read back as VmHWM).

Table 1 (budgets): build a ~5M-parameter MLP and a 2048-sample batch, plan with the budget, run
one local update with the planned micro-batch. Budgets are the runtime's baseline plus 1, 3/4,
1/2 and 1/4 of the unconstrained update's increment over it.

Table 2 (partial against full personalization, spec §4, the paper's Table 10): the same MLP,
one FedAlt round (FedAvg for no personalization) held as an agent holds it: the decoded broadcast
model, the stored personal state, the working model, then the delta formed and packed. The
increment is the peak over the process's resident memory before the model is built. Full
personalization is the paper's: the device trains a shared copy of the whole model and a personal
copy (3|u| + 2|v| with |v| = |u|). The planner's estimate (`memory_model`) stands beside each.

    python -m benchmarks.memory [--out docs/benchmarks.md] [--only budget|modes]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from benchmarks.common import publish_section, write_section
from device_agent.algorithms import build_local_update
from device_agent.algorithms.base import LocalContext
from device_agent.memory_plan import memory_model, plan_training
from device_agent.training import StepBudget, TrainSpec, difference, snapshot, train
from pfl_tasks.base import DeviceData, PartitionSpec, Split
from pfl_tasks.models import Classification, build_seeded, insert_adapters
from pfl_tasks.presets import resolve_preset
from pfl_tasks.split import ParamSplit
from protocols.algorithms import parse_algorithm_config
from protocols.codec import pack_tensors
from protocols.errors import MemoryBudgetError

MARKER = "<!-- memory-budget -->"
MODES_MARKER = "<!-- memory-personalization -->"
MODES = ("none", "output", "input", "adapters", "all-preset", "full")
MODE_LABELS = {
    "none": "no personalization (FedAvg)",
    "output": "output layer",
    "input": "input layer",
    "adapters": f"adapters (bottleneck {16})",
    "all-preset": "`all` preset (global copy stays on the coordinator)",
    "full": "full personalization (shared copy + personal copy)",
}
MODE_BATCH = 32
MODE_SAMPLES = 256
PAPER_SAVINGS = "42% / 34% / 39% (Stack Overflow / GLDv2 / EMNIST)"
BATCH = 2048
WIDTH = 2048
INPUTS = 512


class _WideTask(Classification):
    """The wide MLP's task; the benchmark makes its data itself, so there is no fleet."""

    name: ClassVar[str] = "wide-mlp"
    personal_patterns: tuple[str, ...] = ("output.*",)
    input_names: tuple[str, ...] = ("inputs",)
    output_names: tuple[str, ...] = ("logits",)

    def build_model(self, seed: int) -> nn.Module:
        return build_seeded(seed, _wide_mlp)

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        msg = "the memory benchmark makes its own data"
        raise NotImplementedError(msg)


def status_kib(field: str) -> int:
    """One kB figure of /proc/self/status: VmHWM (peak resident set) or VmRSS (now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    msg = f"{field} not found: memory figures need Linux /proc"
    raise RuntimeError(msg)


def _wide_mlp() -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            hidden=nn.Linear(INPUTS, WIDTH), act=nn.ReLU(), hidden2=nn.Linear(WIDTH, WIDTH),
            act2=nn.ReLU(), output=nn.Linear(WIDTH, 10),
        )
    )  # fmt: skip


class _SharedAndPersonal(nn.Module):
    """Full personalization as the paper counts it: a shared copy u and a personal copy v.

    The prediction is the mean of the two, so each phase of FedAlt trains one whole copy.
    """

    def __init__(self) -> None:
        super().__init__()
        self.shared_copy = _wide_mlp()
        self.personal_copy = _wide_mlp()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The mean of both copies' logits."""
        logits: torch.Tensor = (self.shared_copy(inputs) + self.personal_copy(inputs)) / 2
        return logits


def _mode_model(mode: str) -> tuple[nn.Module, tuple[str, ...]]:
    """The model and its personal patterns for one personalization mode."""
    if mode == "full":
        return _SharedAndPersonal(), ("personal_copy.*",)
    model: nn.Module = _wide_mlp()
    if mode == "adapters":
        model = insert_adapters(model, 16, seed=0)
    preset = {"all-preset": "all"}.get(mode, mode)
    return model, resolve_preset(preset, model)


def mode_child(mode: str) -> dict[str, object]:
    """One FedAlt (FedAvg for "none") round in this fresh process, held as an agent holds it."""
    torch.manual_seed(0)
    task = _WideTask()
    train_split = Split(torch.randn(MODE_SAMPLES, INPUTS), torch.randint(0, 10, (MODE_SAMPLES,)))
    data = DeviceData(device_index=0, train=train_split, val=train_split, test=train_split)
    warm = nn.Sequential(nn.Linear(INPUTS, 64), nn.ReLU(), nn.Linear(64, 10))
    task.loss(warm(train_split.inputs[:MODE_BATCH]), train_split.targets[:MODE_BATCH]).backward()
    del warm  # the runtime (threads, kernels, allocator) is warm; nothing of the model exists yet
    baseline = status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")
    model, patterns = _mode_model(mode)
    split = ParamSplit.for_model(model, patterns)
    algorithm = "fedavg" if mode == "none" else "fedalt"
    config = parse_algorithm_config(
        algorithm, {"local_epochs": 1, "batch_size": MODE_BATCH, "lr": 0.01, "personal": patterns}
    )
    received = snapshot(model, tuple(model.state_dict()))  # the decoded broadcast model
    personal = snapshot(model, split.personal)  # the stored personal state
    ctx = LocalContext(
        model=model,
        task=task,
        data=data,
        split=split,
        config=config,
        global_shared={name: received[name] for name in split.shared},
        personal=personal,
        generator=torch.Generator().manual_seed(0),
    )
    result = build_local_update(algorithm).run(ctx)
    pack_tensors(result.shared_delta)
    peak = status_kib("VmHWM") * 1024
    del received, personal, ctx, result
    terms = memory_model(model, task, train_split, split)
    parameters = dict(model.named_parameters())
    return {
        "mode": mode,
        "baseline": baseline,
        "increment": peak - baseline,
        "planned": terms.peak(MODE_BATCH) - terms.runtime_bytes,
        "parameters": sum(p.numel() for p in parameters.values()),
        "personal": sum(parameters[n].numel() for n in split.personal if n in parameters),
        "shared": sum(parameters[n].numel() for n in split.shared if n in parameters),
    }


def child(fraction: float | None, increment: int) -> dict[str, object]:
    """One measurement in this (fresh) process."""
    torch.manual_seed(0)
    model = _wide_mlp()
    data = Split(torch.randn(BATCH, INPUTS), torch.randint(0, 10, (BATCH,)))
    task = _WideTask()
    split = ParamSplit.for_model(model, ())
    names = tuple(n for n, _ in model.named_parameters())
    terms = memory_model(model, task, data, split)  # probes: afterwards the runtime is warm
    baseline = status_kib("VmRSS") * 1024
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
        peak=status_kib("VmHWM") * 1024,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return result


def _in_fresh_process(flag: str, argument: str) -> dict[str, Any]:
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", flag, argument],
        check=True,
        capture_output=True,
        text=True,
    )
    measured: dict[str, Any] = json.loads(output.stdout.strip().splitlines()[-1])
    return measured


def measure(fraction: float | None, increment: int) -> dict[str, Any]:
    """Run `child` in a fresh interpreter, so peaks do not carry over."""
    return _in_fresh_process("--child", json.dumps([fraction, increment]))


def measure_mode(mode: str, repeats: int = 3) -> dict[str, Any]:
    """`mode_child` in fresh interpreters; the median increment of `repeats` runs."""
    runs = sorted(
        (_in_fresh_process("--mode-child", mode) for _ in range(repeats)),
        key=lambda run: int(run["increment"]),
    )
    return runs[len(runs) // 2]


def modes_section() -> str:
    """Table 2: training memory of partial against full personalization."""
    mib = 2**20
    runs = {mode: measure_mode(mode) for mode in MODES}
    rows = [
        "| mode | shared params | personal params | measured increment (MiB) "
        "| planner estimate (MiB) | x model size |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    model_bytes = int(runs["none"]["parameters"]) * 4
    for mode in MODES:
        run = runs[mode]
        rows.append(
            f"| {MODE_LABELS[mode]} | {int(run['shared']):,} | {int(run['personal']):,} | "
            f"{int(run['increment']) / mib:.1f} | {int(run['planned']) / mib:.1f} | "
            f"{int(run['increment']) / model_bytes:.1f} |"
        )
    partial = ("output", "input", "adapters")
    best = min(partial, key=lambda mode: int(runs[mode]["increment"]))
    full = int(runs["full"]["increment"])
    saving = (full - int(runs[best]["increment"])) / full
    planned_best = min(int(runs[mode]["planned"]) for mode in partial)
    planned_saving = (int(runs["full"]["planned"]) - planned_best) / int(runs["full"]["planned"])
    return "\n".join(
        [
            MODES_MARKER,
            "## Training memory of partial against full personalization",
            "",
            f"The MLP {INPUTS}-{WIDTH}-{WIDTH}-10 ({int(runs['none']['parameters']):,} parameters, "
            f"{model_bytes / mib:.1f} MiB fp32); one local round of FedAlt (FedAvg for no "
            f"personalization) over {MODE_SAMPLES} samples in minibatches of {MODE_BATCH}, one "
            "epoch per phase, plain SGD. Held as an agent holds it: the decoded broadcast model, "
            "the stored personal state, the working model and its gradients, then the shared "
            "delta formed and packed. Measured increment = peak RSS (VmHWM) of a fresh process "
            "over its resident memory before the model is built, median of 3 processes. The "
            "planner's estimate is `memory_model`'s M(b) - R at b = "
            f"{MODE_BATCH}: 4|w| (what device_agent/memory_plan.py counts an agent holding "
            "around a round, from this table), a step's overhead and the probed activations, "
            "margins included. Full "
            "personalization is the paper's: a shared "
            "copy and a personal copy of the whole model, trained in turn (|v| = |u|); the `all` "
            "preset is the toolkit's, where nothing is shared and the global copy stays on the "
            "coordinator.",
            "",
            *rows,
            "",
            f"Saving of the best partial mode ({MODE_LABELS[best]}) against full personalization: "
            f"**{saving:.0%}** measured, {planned_saving:.0%} by the planner; the paper's Table 10 "
            f"reports {PAPER_SAVINGS}.",
            "",
            "Command: `python -m benchmarks.memory` (both tables; `--only modes` for this one).",
            MODES_MARKER,
        ]
    )


def main() -> None:
    """Measure and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--only", choices=("budget", "modes"), default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        fraction, increment = json.loads(args.child)
        print(json.dumps(child(fraction, increment)))
        return
    if args.mode_child is not None:
        print(json.dumps(mode_child(args.mode_child)))
        return
    if args.only != "modes":
        budget_section(args.out)
    if args.only != "budget":
        section = modes_section()
        write_section(args.out, section, MODES_MARKER)
        print(section)


def budget_section(out: Path) -> None:
    """Table 1: measure under budgets and write the section."""
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
    publish_section(
        out,
        MARKER,
        [
            "## Peak memory of one local update under a budget",
            "",
            f"An MLP {INPUTS}-{WIDTH}-{WIDTH}-10 ({int(free['parameters']):,} parameters), one SGD "
            f"step on a batch of {BATCH}; runtime baseline {int(free['baseline']) / mib:.0f} MiB, "
            f"unconstrained increment {increment / mib:.0f} MiB. Peak = VmHWM of a fresh process.",
            "",
            *rows,
            "",
            "Command: `python -m benchmarks.memory`.",
        ],
    )


if __name__ == "__main__":
    main()
