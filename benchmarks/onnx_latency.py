"""ONNX inference latency: onnxruntime (fp32 and int8) against PyTorch eager, per built-in task.

Each built-in task's model is trained briefly on one device's data, exported through the real
`export.export_model` path (parity-checked, with an int8 file beside it), then timed side by side
in one process: for each batch size, each repeat times a block of calls of every runner in turn
(PyTorch eager under inference_mode, onnxruntime fp32, onnxruntime int8), after a warm-up. The
median per-call latency over repeats is reported, with throughput, file sizes and the held-out
metric of each file. PyTorch and onnxruntime get the same number of intra-op threads (default 1:
these models are too small to split, and a busy machine makes spinning worker threads noisy).

    python -m benchmarks.onnx_latency [--repeats 15] [--threads N] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from benchmarks.common import write_section
from export import ExportProvenance, ExportResult, export_model
from export.parity import make_session
from pfl_tasks.base import PartitionSpec, Split, Task
from pfl_tasks.registry import load_task

MARKER = "<!-- onnx-latency -->"
CASES: list[tuple[str, str, dict[str, object]]] = [
    ("digits", "digits (MLP 64-64-10)", {}),
    ("synthetic", "synthetic (MLP 60-32-10)", {"model": "mlp"}),
    ("synthetic", "synthetic (MCLR 60-10)", {"model": "mclr"}),
    ("gaussian", "gaussian (scalar)", {}),
    ("sine", "sine (line)", {}),
]
BATCH_SIZES = (1, 32)
BLOCK_SECONDS = 0.02
TRAIN_STEPS = 300
TRAIN_LR = 0.1


@dataclass(frozen=True)
class Row:
    """One (task, batch size) line of the latency table."""

    label: str
    batch: int
    eager_s: float
    fp32_s: float
    int8_s: float


def train_briefly(model: nn.Module, task: Task, split: Split) -> nn.Module:
    """Full-batch SGD so the int8 metric change is measured on a model that has learned."""
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    model.train()
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        task.loss(model(split.inputs), split.targets).backward()
        optimizer.step()
    return model.eval()


def per_call_seconds(call: Callable[[], object], calls: int) -> float:
    """Mean seconds per call over one block of `calls` back-to-back calls."""
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def calls_per_block(call: Callable[[], object]) -> int:
    """How many calls fill about BLOCK_SECONDS, so fast and slow runners are timed alike."""
    single = max(per_call_seconds(call, 20), 1e-7)
    return max(10, int(BLOCK_SECONDS / single))


def time_side_by_side(runners: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median per-call seconds of each runner, alternating runners within every repeat."""
    blocks = {name: calls_per_block(call) for name, call in runners.items()}  # also the warm-up
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, call in runners.items():
            samples[name].append(per_call_seconds(call, blocks[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def export_case(task: Task, directory: Path) -> tuple[nn.Module, ExportResult, Split]:
    """Train one device's model and export it, with int8, through the real export path."""
    device = task.make_fleet(4, PartitionSpec(scheme="iid"), seed=0)[0]
    model = train_briefly(task.build_model(0), task, device.train)
    provenance = ExportProvenance(
        algorithm="local",
        round_id=0,
        device_id="bench",
        chosen="personalized",
        personalized_metric=float("nan"),
        global_metric=float("nan"),
    )
    result = export_model(
        model,
        task,
        directory / f"{task.name}.onnx",
        provenance=provenance,
        shared=dict(model.state_dict()),
        heldout=device.test,
        quantize="int8",
    )
    return model, result, device.test


def run_eager(model: nn.Module, inputs: torch.Tensor) -> object:
    """One PyTorch eager call the way a deployment would make it (no autograd bookkeeping)."""
    with torch.inference_mode():
        return model(inputs)


def measure(
    label: str, model: nn.Module, result: ExportResult, heldout: Split, threads: int, repeats: int
) -> list[Row]:
    """Latency rows for one exported model at every batch size."""
    if result.quantized is None:
        msg = "the benchmark exports with quantize='int8'"
        raise RuntimeError(msg)
    sessions = {
        "fp32": make_session(result.path, threads=threads),
        "int8": make_session(result.quantized.path, threads=threads),
    }
    input_name = sessions["fp32"].get_inputs()[0].name
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in BATCH_SIZES:
        index = torch.randint(0, len(heldout), (batch,), generator=generator)
        inputs = heldout.inputs[index].contiguous()
        feed = {input_name: np.ascontiguousarray(inputs.numpy())}

        medians = time_side_by_side(
            {
                "eager": functools.partial(run_eager, model, inputs),
                "fp32": functools.partial(sessions["fp32"].run, None, feed),
                "int8": functools.partial(sessions["int8"].run, None, feed),
            },
            repeats,
        )
        rows.append(Row(label, batch, medians["eager"], medians["fp32"], medians["int8"]))
    return rows


def render(
    rows: list[Row], sizes: list[tuple[str, ExportResult]], repeats: int, threads: int
) -> str:
    """The markdown section, markers included."""
    lines = [
        MARKER,
        "## ONNX inference latency against PyTorch eager",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the start; {threads} intra-op thread(s) for both runtimes, "
        f"torch {torch.__version__}, onnxruntime {ort.__version__} (CPUExecutionProvider); "
        f"median per-call latency of {repeats} alternating repeats after a warm-up. Models are "
        f"trained briefly on one device and exported by `export.export_model` (opset "
        f"{sizes[0][1].opset}, dynamic batch axis, int8 = `quantize_dynamic`).",
        "",
        "| model | batch | PyTorch eager µs | ORT fp32 µs | ORT int8 µs | fp32 speed-up "
        "| throughput eager / fp32 / int8 (samples/s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        throughput = " / ".join(
            f"{row.batch / seconds:,.0f}" for seconds in (row.eager_s, row.fp32_s, row.int8_s)
        )
        lines.append(
            f"| {row.label} | {row.batch} | {row.eager_s * 1e6:.1f} | {row.fp32_s * 1e6:.1f} "
            f"| {row.int8_s * 1e6:.1f} | {row.eager_s / row.fp32_s:.1f}x | {throughput} |"
        )
    lines += [
        "",
        "| model | fp32 file bytes | int8 file bytes | int8 / fp32 | held-out metric fp32 "
        "| int8 | fp32 max abs diff | int8 max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, result in sizes:
        quantized = result.quantized
        if quantized is None:
            continue
        lines.append(
            f"| {label} | {result.size_bytes:,} | {quantized.size_bytes:,} "
            f"| {quantized.size_bytes / result.size_bytes:.2f} "
            f"| {result.metric_name} {result.metric:.4g} | {quantized.metric:.4g} "
            f"| {result.parity_max_abs_diff:.2g} | {quantized.parity_max_abs_diff:.2g} |"
        )
    lines += [
        "",
        f"Sizes include the pfl metadata ({metadata_bytes(sizes[0][1]):,} bytes of keys and "
        "values), which dominates the tiny models; int8 only pays off once the weights outweigh "
        "the quantization nodes it adds. At these sizes int8 saves bytes, not time: quantizing "
        "activations on every call costs more than the cheaper matrix products save. Held-out "
        "metrics are computed by onnxruntime.",
        "",
        "Command: `python -m benchmarks.onnx_latency`.",
        MARKER,
    ]
    return "\n".join(lines)


def metadata_bytes(result: ExportResult) -> int:
    """Bytes of metadata keys and values, to tell file size from model size."""
    return sum(len(key) + len(value) for key, value in result.metadata.items())


def main() -> None:
    """Export every built-in task's model, time all three runtimes, write the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads for both runtimes (1 suits models this small)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    sizes: list[tuple[str, ExportResult]] = []
    with tempfile.TemporaryDirectory(prefix="pfl-onnx-latency-") as directory:
        for name, label, options in CASES:
            task = load_task(name, options)
            model, result, heldout = export_case(task, Path(directory))
            sizes.append((label, result))
            rows += measure(label, model, result, heldout, args.threads, args.repeats)
    section = render(rows, sizes, args.repeats, args.threads)
    write_section(args.out, section, MARKER)
    print(section)


if __name__ == "__main__":
    main()
