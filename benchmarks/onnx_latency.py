"""ONNX inference latency: onnxruntime (fp32 and int8) against PyTorch eager, per model.

Each built-in task's model, and a CNN, a BatchNorm CNN and a GRU on the digits, is trained
briefly on one device's data, exported through the real `export.export_model` path
(parity-checked, BatchNorm folded), quantized to int8 dynamically and statically (calibrated on
the device's own training inputs), then timed side by side in one process: for each batch size,
each repeat times a block of calls of every runner in turn (PyTorch eager under inference_mode,
onnxruntime fp32, int8 dynamic, int8 static), after a warm-up. The
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
    ("examples.cnn_digits:task", "digits CNN (2 conv)", {}),
    ("tests.normalization.bn_models:task", "digits CNN + BatchNorm (folded)", {}),
    ("tests.export.edge_models:gru_task", "digits GRU (8 rows x 8)", {}),
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
    static_s: float


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


def export_case(task: Task, directory: Path) -> tuple[nn.Module, ExportResult, ExportResult, Split]:
    """Train one device's model and export it twice through the real export path.

    First with int8 dynamic, then int8 static calibrated on the device's training inputs; the
    fp32 file is the same.
    """
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
    results = [
        export_model(
            model,
            task,
            directory / quantize / f"{task.name}.onnx",
            provenance=provenance,
            shared=dict(model.state_dict()),
            heldout=device.test,
            quantize=quantize,
            calibration=device.train.inputs,
        )
        for quantize in ("int8", "int8-static")
    ]
    return model, results[0], results[1], device.test


def run_eager(model: nn.Module, inputs: torch.Tensor) -> object:
    """One PyTorch eager call the way a deployment would make it (no autograd bookkeeping)."""
    with torch.inference_mode():
        return model(inputs)


def measure(
    label: str,
    model: nn.Module,
    results: tuple[ExportResult, ExportResult],
    heldout: Split,
    threads: int,
    repeats: int,
) -> list[Row]:
    """Latency rows for one exported model at every batch size."""
    dynamic, static = (result.quantized for result in results)
    if dynamic is None or static is None:
        msg = "the benchmark exports with quantize='int8' and 'int8-static'"
        raise RuntimeError(msg)
    sessions = {
        "fp32": make_session(results[0].path, threads=threads),
        "int8": make_session(dynamic.path, threads=threads),
        "static": make_session(static.path, threads=threads),
    }
    input_name = sessions["fp32"].get_inputs()[0].name
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in BATCH_SIZES:
        index = torch.randint(0, len(heldout), (batch,), generator=generator)
        inputs = heldout.inputs[index].contiguous()
        feed = {input_name: np.ascontiguousarray(inputs.numpy())}
        runners: dict[str, Callable[[], object]] = {
            "eager": functools.partial(run_eager, model, inputs)
        }
        runners |= {name: functools.partial(s.run, None, feed) for name, s in sessions.items()}
        medians = time_side_by_side(runners, repeats)
        rows.append(
            Row(label, batch, *(medians[name] for name in ("eager", "fp32", "int8", "static")))
        )
    return rows


def render(
    rows: list[Row],
    sizes: list[tuple[str, ExportResult, ExportResult]],
    repeats: int,
    threads: int,
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
        f"{sizes[0][1].opset}, dynamic batch axis, BatchNorm folded into the layer before it; "
        "int8 dyn = `quantize_dynamic`, int8 static = `quantize_static` in QDQ format, "
        "calibrated on the device's own training inputs).",
        "",
        "| model | batch | PyTorch eager µs | ORT fp32 µs | ORT int8 dyn µs | ORT int8 static µs "
        "| fp32 speed-up | throughput eager / fp32 / int8 dyn / int8 static (samples/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        times = (row.eager_s, row.fp32_s, row.int8_s, row.static_s)
        throughput = " / ".join(f"{row.batch / seconds:,.0f}" for seconds in times)
        lines.append(
            f"| {row.label} | {row.batch} | {row.eager_s * 1e6:.1f} | {row.fp32_s * 1e6:.1f} "
            f"| {row.int8_s * 1e6:.1f} | {row.static_s * 1e6:.1f} "
            f"| {row.eager_s / row.fp32_s:.1f}x | {throughput} |"
        )
    lines += [
        "",
        "| model | fp32 file bytes | int8 dyn bytes | int8 static bytes | held-out metric fp32 "
        "| int8 dyn | int8 static | fp32 max abs diff | int8 dyn max abs diff "
        "| int8 static max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, result, static_result in sizes:
        dynamic, static = result.quantized, static_result.quantized
        if dynamic is None or static is None:
            continue
        lines.append(
            f"| {label} | {result.size_bytes:,} | {dynamic.size_bytes:,} "
            f"| {static.size_bytes:,} | {result.metric_name} {result.metric:.4g} "
            f"| {dynamic.metric:.4g} | {static.metric:.4g} "
            f"| {result.parity_max_abs_diff:.2g} | {dynamic.parity_max_abs_diff:.2g} "
            f"| {static.parity_max_abs_diff:.2g} |"
        )
    lines += [
        "",
        f"Sizes include the pfl metadata (about {metadata_bytes(sizes[0][1]):,} bytes of keys and "
        "values), which dominates the tiny models; int8 only pays off once the weights outweigh "
        "the quantization nodes it adds. Held-out metrics are computed by onnxruntime. The CNN, "
        "BatchNorm CNN and GRU rows use models defined beside the tests "
        "(`examples.cnn_digits:task`, `tests.normalization.bn_models:task`, "
        "`tests.export.edge_models:gru_task`); the BatchNorm CNN's file has no "
        "BatchNormalization node (all three folded, checked by "
        "`tests/export/test_export_edge_models.py`). Static int8 fixes every activation's range "
        "at export, so a call computes none; onnxruntime has no int8 GRU kernel, so in the GRU "
        "only the linear head is quantized. The timings are of one run on a shared machine (see "
        "its load average above): compare columns within a row, not rows between runs.",
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
    sizes: list[tuple[str, ExportResult, ExportResult]] = []
    with tempfile.TemporaryDirectory(prefix="pfl-onnx-latency-") as directory:
        for name, label, options in CASES:
            task = load_task(name, options)
            model, dynamic, static, heldout = export_case(task, Path(directory))
            sizes.append((label, dynamic, static))
            results = (dynamic, static)
            rows += measure(label, model, results, heldout, args.threads, args.repeats)
    section = render(rows, sizes, args.repeats, args.threads)
    write_section(args.out, section, MARKER)
    print(section)


if __name__ == "__main__":
    main()
