"""Bytes against accuracy: compressed updates and models, and selected-only downloads.

Three measurements, all through the real coordinator and agents on the in-process hub (the bytes
are the encoded frames an MQTT broker would carry):

1. Uplink codecs: digits (20 devices, Dirichlet(0.3)) and synthetic (20 devices), FedAvg and
   FedAlt, `--compress none|int8|topk:0.1|topk:0.01`, several seeds: bytes up per round, bytes
   per update against the raw float32 shared size, final personalized accuracy.
2. Selected-only downloads: digits, 100 devices, FedAvg at participation p (and synthetic with
   1000 devices at 10%): bytes down per training round against p x devices x model frame (plus
   one announcement per device), and what the devices received in all.
3. int8 downlink at full participation: bytes down per round against whole models.

    python -m benchmarks.compression [--seeds 3] [--rounds 30] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import init_worker, markdown_table, mean_std_cell, write_section
from coordinator.engine.rounds import RoundRecord
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import encode_frame, pack_tensors
from protocols.compression import encode
from protocols.messages import Compression, DeviceUpdate, SharedModel
from protocols.transport.inprocess import InProcessBroker

MARKER = "<!-- compression -->"
CODECS = ("none", "int8", "topk:0.1", "topk:0.01")
ALGORITHMS = ("fedavg", "fedalt")
TASKS: dict[str, dict[str, Any]] = {
    "digits": {"devices": 20, "partition": "dirichlet", "alpha": 0.3},
    "synthetic": {"devices": 20},
}
PLOT = Path("docs/img/compression-accuracy-bytes.png")


@dataclass(frozen=True)
class Cell:
    """One run's figures."""

    task: str
    algorithm: str
    codec: str
    seed: int
    rounds: int
    accuracy: float
    bytes_up_per_round: float
    bytes_per_update: float
    bytes_down_per_round: float
    raw_shared_bytes: int


def run_cell(task: str, algorithm: str, codec: str, seed: int, rounds: int) -> Cell:
    """One simulated run with `codec` on the uplink."""
    settings = SimulationSettings.load(
        None,
        workers=1,
        task=task,
        algorithm=algorithm,
        rounds=rounds,
        seed=seed,
        compress=codec,
        **TASKS[task],
    )
    result = run_simulation(settings)
    training = result.records[:-1] or result.records  # the last record holds the evaluation
    return Cell(
        task=task,
        algorithm=algorithm,
        codec=codec,
        seed=seed,
        rounds=rounds,
        accuracy=float((result.summary.metrics or {}).get("personalized_mean") or 0.0),
        bytes_up_per_round=statistics.fmean(r.bytes_up for r in training),
        bytes_per_update=statistics.median(r.bytes_up / r.participants for r in training),
        bytes_down_per_round=statistics.fmean(r.bytes_down for r in training),
        raw_shared_bytes=sum(4 * t.numel() for t in result.final_shared.values()),
    )


def _run(arguments: tuple[str, str, str, int, int]) -> Cell:
    return run_cell(*arguments)


def downloads(
    participation: float, downlink: str = "none", *, task: str = "digits", devices: int = 100
) -> dict[str, Any]:
    """Bytes down per training round against p x devices x model frame, with FedAvg.

    Also what the devices' transports received over the whole run (final evaluation included)
    against what the devices sent.
    """
    settings = SimulationSettings.load(
        None,
        workers=1,
        task=task,
        algorithm="fedavg",
        devices=devices,
        rounds=10,
        participation=participation,
        compress_down=downlink,
        seed=0,
    )
    hub = InProcessBroker()
    per_round: list[dict[str, int]] = []

    def after_round(record: RoundRecord) -> None:
        models = hub.delivered[topics.shared_model("default")]
        models += hub.delivered[topics.model_delta("default")]
        per_round.append({"all": record.bytes_down, "models": models})
        hub.delivered.clear()

    result = run_simulation(settings, on_round=after_round, broker=hub)
    sent, received = result.device_bytes()
    training = per_round[1:-1]  # from round 2 (round 1 also sends the first model), no evaluation
    return {
        "task": task,
        "devices": devices,
        "participation": participation,
        "downlink": downlink,
        "bytes_down_per_round": statistics.fmean(r["all"] for r in training),
        "model_bytes_per_round": statistics.fmean(r["models"] for r in training),
        "model_frame": _model_frame_bytes(task),
        "device_received": received,
        "device_sent": sent,
    }


def _model_frame_bytes(task: str) -> int:
    manifest, blob = pack_tensors(load_task(task).build_model(0).state_dict())
    return len(encode_frame(SharedModel(round_id=1, manifest=manifest), blob))


def render(
    cells: Sequence[Cell],
    long_cells: Sequence[Cell],
    down: Sequence[dict[str, Any]],
    seeds: int,
    rounds: int,
) -> str:
    """The markdown section."""
    lines = [
        MARKER,
        "## Bandwidth: compressed updates, selected-only downloads, int8 model deltas",
        "",
        f"Uplink: {rounds} rounds, {seeds} seeds (mean ± std), full participation, error "
        "feedback on stateful devices. Bytes are whole frames (JSON header, manifest and "
        "tensors) as the coordinator received them; *per update / raw* divides one update by "
        "the float32 size of the shared tensors, so on these small models (digits FedAvg "
        "19 KB, FedAlt 17 KB, synthetic 2.4 KB) the fixed header weighs in.",
        "",
    ]
    header = [
        "task",
        "algorithm",
        "codec",
        "bytes up / round",
        "vs none",
        "per update / raw",
        "personalized accuracy",
        "Δ vs none (points)",
    ]
    lines += markdown_table(header, _uplink_rows(cells, CODECS))
    long_rounds = long_cells[0].rounds if long_cells else 0
    lines += [
        "",
        f"Top-1% moves 1% of the entries a round, so FedAvg needs more rounds: {long_rounds} "
        "rounds, the same seeds:",
        "",
        *markdown_table(header, _uplink_rows(long_cells, ("none", "topk:0.01"))),
    ]
    lines += [
        "",
        f"![accuracy against bytes up]({PLOT.relative_to('docs')})",
        "",
        "Downlink: FedAvg, 10 rounds, bytes the devices received in training rounds 2 to 9 "
        "(mean per round): all of it (announcements, own status echoes, models) and the model "
        "frames alone (whole or delta), against p x devices x model frame. *Run total* is what "
        "the devices received and sent over the whole run, including the final evaluation, "
        "for which every device fetches the last model.",
        "",
    ]
    rows = [
        [
            f"{d['task']}, {d['devices']}",
            f"{d['participation']:g}",
            str(d["downlink"]),
            f"{d['bytes_down_per_round']:,.0f}",
            f"{d['model_bytes_per_round']:,.0f}",
            f"**{d['model_bytes_per_round'] / _selected_models(d):.3f}x**",
            f"{d['devices'] * d['model_frame']:,.0f}",
            f"{d['device_received'] / 1e6:.1f} MB / {d['device_sent'] / 1e6:.1f} MB",
        ]
        for d in down
    ]
    lines += markdown_table(
        [
            "task, devices",
            "participation p",
            "model codec",
            "received / round",
            "model bytes / round",
            "vs p x devices x model",
            "a model to every device",
            "run total received / sent",
        ],
        rows,
    )
    lines += [
        "",
        "Update size by model size: one update frame per codec against the raw float32 size, "
        "and in brackets its tensor payload alone; the JSON header (run id, manifest, checksum) "
        "is about 0.5-0.7 KB whatever the model.",
        "",
    ]
    lines += markdown_table(["parameters", "raw bytes", *CODECS], frame_sizes())
    lines += ["", "Command: `python -m benchmarks.compression`.", MARKER]
    return "\n".join(lines)


def _uplink_rows(cells: Sequence[Cell], codecs: Sequence[str]) -> list[list[str]]:
    """One row per task, algorithm and codec, against the same group's uncompressed runs."""
    rows = []
    for task in TASKS:
        for algorithm in ALGORITHMS:
            group = [c for c in cells if c.task == task and c.algorithm == algorithm]
            base = [c for c in group if c.codec == "none"]
            if not base:
                continue
            base_up = statistics.fmean(c.bytes_up_per_round for c in base)
            base_acc = statistics.fmean(c.accuracy for c in base)
            for codec in codecs:
                runs = [c for c in group if c.codec == codec]
                if not runs:
                    continue
                up = statistics.fmean(c.bytes_up_per_round for c in runs)
                per_raw = statistics.fmean(c.bytes_per_update / c.raw_shared_bytes for c in runs)
                delta = 100 * (statistics.fmean(c.accuracy for c in runs) - base_acc)
                rows.append(
                    [
                        task,
                        algorithm,
                        codec,
                        f"{up:,.0f}",
                        f"{up / base_up:.3f}x",
                        f"{per_raw:.3f}x",
                        mean_std_cell([c.accuracy for c in runs]),
                        f"{delta:+.1f}",
                    ]
                )
    return rows


def _selected_models(row: dict[str, Any]) -> float:
    """The bytes of one model to each selected device: p x devices x model frame."""
    return float(row["participation"] * row["devices"] * row["model_frame"])


def frame_sizes(hidden: Sequence[int] = (64, 1000, 13_500)) -> list[list[str]]:
    """Bytes of one update frame per codec against raw float32, for digits MLPs of several widths.

    Sizes do not depend on the values, so a random delta stands in for a trained one.
    """
    rows = []
    for width in hidden:
        state = load_task("digits", {"hidden": width}).build_model(0).state_dict()
        delta = {name: torch.randn_like(value) for name, value in state.items()}
        raw = sum(4 * value.numel() for value in delta.values())
        row = [f"{sum(v.numel() for v in delta.values()):,}", f"{raw:,}"]
        for codec in CODECS:
            compression = Compression.parse(codec)
            manifest, blob = pack_tensors(encode(delta, compression))
            header = DeviceUpdate(
                run_id="0" * 32,
                round_id=1,
                device_id="dev-0000",
                algorithm="fedavg",
                num_samples=1,
                train_loss=0.0,
                compression=compression,
                manifest=manifest,
            )
            frame = encode_frame(header, blob)
            row.append(f"{len(frame) / raw:.3f}x ({len(blob) / raw:.3f}x)")
        rows.append(row)
    return rows


def plot(cells: Sequence[Cell], path: Path) -> None:
    """Personalized accuracy against bytes up per round, one panel per task and algorithm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    figure = Figure(figsize=(12, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    panels = [(t, a) for t in TASKS for a in ALGORITHMS]
    for index, (task, algorithm) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1)
        for codec, marker in zip(CODECS, "osD^", strict=True):
            runs = [c for c in cells if (c.task, c.algorithm, c.codec) == (task, algorithm, codec)]
            if runs:
                axes.scatter(
                    [c.bytes_up_per_round for c in runs],
                    [c.accuracy for c in runs],
                    marker=marker,
                    label=codec,
                )
        axes.set_xscale("log")
        axes.xaxis.set_minor_formatter(NullFormatter())  # overlapping labels on a short range
        axes.set_xlabel("bytes up per round")
        axes.set_title(f"{task}, {algorithm}", fontsize="medium")
        axes.grid(alpha=0.3)
        if index == 0:
            axes.set_ylabel("personalized accuracy")
            axes.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def main(argv: Sequence[str] | None = None) -> None:
    """Run every cell, then write the section and the plot."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--long-rounds", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    arguments = parser.parse_args(argv)
    jobs = [
        (task, algorithm, codec, seed, arguments.rounds)
        for task in TASKS
        for algorithm in ALGORITHMS
        for codec in CODECS
        for seed in range(arguments.seeds)
    ]
    longer = [
        (task, "fedavg", codec, seed, arguments.long_rounds)
        for task in TASKS
        for codec in ("none", "topk:0.01")
        for seed in range(arguments.seeds)
    ]
    with ProcessPoolExecutor(arguments.workers, initializer=init_worker) as pool:
        cells = list(pool.map(_run, jobs))
        long_cells = list(pool.map(_run, longer))
    init_worker()
    down = [downloads(p) for p in (0.1, 0.3, 1.0)]
    down.append(downloads(1.0, "int8"))
    down.append(downloads(0.1, task="synthetic", devices=1000))
    plot(cells, PLOT)
    section = render(cells, long_cells, down, arguments.seeds, arguments.rounds)
    write_section(arguments.out, section, MARKER)
    print(section)


if __name__ == "__main__":
    main()
