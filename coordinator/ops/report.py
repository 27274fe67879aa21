"""`pfl-coord report`: PNG plots of a run directory or a compare directory (matplotlib, Agg)."""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

PLOTS_DIR: Final = "plots"
ACCURACY_PNG: Final = "accuracy.png"
LOSS_PNG: Final = "train_loss.png"
HISTOGRAM_PNG: Final = "device_histogram.png"
GAIN_PNG: Final = "gain_vs_samples.png"


@dataclass
class RunData:
    """One run directory's records: metrics.jsonl lines, devices.jsonl lines and summary.json."""

    path: Path
    algorithm: str
    rounds: list[dict[str, Any]]
    devices: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def metric_name(self) -> str:
        """The task's metric (accuracy, mse), from the summary or the device reports."""
        name = self.summary.get("metric_name")
        if name is None and self.devices:
            name = self.devices[0].get("metric_name")
        return str(name or "accuracy")


@dataclass
class Report:
    """The plots written, and why any were left out."""

    out_dir: Path
    runs: int
    algorithms: list[str]
    plots: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(path: Path) -> RunData:
    """The records of one run directory (written by simulate, serve or compare)."""
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    # compare lays runs out as <algorithm>/seed-<s>/; a lone run without summary uses its name
    fallback = path.parent.name if path.name.startswith("seed-") else path.name
    return RunData(
        path=path,
        algorithm=str(summary.get("algorithm") or fallback),
        rounds=_read_jsonl(path / "metrics.jsonl"),
        devices=_read_jsonl(path / "devices.jsonl"),
        summary=summary,
    )


def find_runs(run_dir: Path) -> list[RunData]:
    """Every run under `run_dir`: itself if it holds metrics.jsonl, else each such subdirectory.

    Raises:
        FileNotFoundError: `run_dir` does not exist or holds no run.
    """
    if not run_dir.is_dir():
        msg = f"run directory not found: {run_dir}"
        raise FileNotFoundError(msg)
    if (run_dir / "metrics.jsonl").is_file():
        return [load_run(run_dir)]
    paths = sorted(p.parent for p in run_dir.rglob("metrics.jsonl") if PLOTS_DIR not in p.parts)
    if not paths:
        msg = (
            f"no metrics.jsonl in {run_dir} or below it; give the --out directory of "
            "`pfl-coord simulate`, `serve` or `compare`"
        )
        raise FileNotFoundError(msg)
    return [load_run(path) for path in paths]


def _by_algorithm(runs: Sequence[RunData], order: Sequence[str] = ()) -> dict[str, list[RunData]]:
    """Runs per algorithm: those in `order` first, in that order, then the rest by name."""
    rank = {name: index for index, name in enumerate(order)}
    grouped: dict[str, list[RunData]] = {}
    for run in sorted(runs, key=lambda r: (rank.get(r.algorithm, len(rank)), r.algorithm)):
        grouped.setdefault(run.algorithm, []).append(run)
    return grouped


def _compare_order(run_dir: Path) -> list[str]:
    """The algorithm order of a compare directory's comparison.json (empty elsewhere)."""
    path = run_dir / "comparison.json"
    if not path.is_file():
        return []
    return [row["algorithm"] for row in json.loads(path.read_text()).get("algorithms", [])]


def curve(runs: Sequence[RunData], key: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and (population) std over runs of an evaluation metric per round.

    `key` names an entry of a round's "evaluation" (e.g. personalized_mean, global), or
    "train_loss". Rounds where no run has the value are left out.
    """
    per_round: dict[int, list[float]] = {}
    for run in runs:
        for line in run.rounds:
            value = (
                line.get(key) if key == "train_loss" else (line.get("evaluation") or {}).get(key)
            )
            if value is not None and math.isfinite(value):
                per_round.setdefault(int(line["round_id"]), []).append(float(value))
    rounds = sorted(per_round)
    means = [statistics.fmean(per_round[r]) for r in rounds]
    stds = [statistics.pstdev(per_round[r]) for r in rounds]
    return rounds, means, stds


def device_gains(runs: Sequence[RunData]) -> list[tuple[int, float]]:
    """(training samples, personalized - global) per device report that has a global score.

    For a metric where lower is better (mse) the gain is global - personalized, so a positive
    gain always means personalization helped.
    """
    points = []
    for run in runs:
        lower_is_better = run.metric_name != "accuracy"
        for device in run.devices:
            personal, shared = device.get("personalized"), device.get("global_model")
            if personal is None or shared is None:
                continue
            gain = (shared - personal) if lower_is_better else (personal - shared)
            points.append((int(device.get("num_train_samples", 0)), float(gain)))
    return points


def _figure(width: float, height: float) -> Figure:
    """A figure on the Agg canvas, without pyplot's global state (safe in any thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _colors(count: int) -> list[Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(index % 10) for index in range(count)]


def _integer_axis(axis: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _panel_figure(count: int) -> Figure:
    """A figure for `count` panels, three per row, wide enough for its title."""
    return _figure(max(6.0, 4.6 * min(count, 3)), 3.6 * math.ceil(count / 3))


def _subplots(figure: Figure, count: int) -> list[Axes]:
    columns = min(count, 3)
    rows = math.ceil(count / columns)
    return [figure.add_subplot(rows, columns, index + 1) for index in range(count)]


def _title(runs: Sequence[RunData]) -> str:
    summary = runs[0].summary
    if not summary:
        return ""
    seeds = sorted(
        {int(run.summary["seed"]) for run in runs if run.summary.get("seed") is not None}
    )
    seed_text = f", mean over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else ""
    return f"{summary.get('task', '')}, {summary.get('devices', '?')} devices{seed_text}"


def plot_accuracy(grouped: dict[str, list[RunData]], path: Path) -> bool:
    """Personalized mean (solid) and global (dashed) metric per round, one color per algorithm.

    With several seeds the line is their mean and the band one standard deviation. Returns
    False (nothing written) when no run evaluated during training.
    """
    figure = _figure(8, 4.8)
    axes = figure.add_subplot()
    drawn = False
    all_runs = [run for runs in grouped.values() for run in runs]
    for color, (algorithm, runs) in zip(_colors(len(grouped)), grouped.items(), strict=True):
        for metric, style, label in (
            ("personalized_mean", "-", "personalized"),
            ("global", "--", "global"),
        ):
            rounds, means, stds = curve(runs, metric)
            if not rounds:
                continue
            drawn = True
            axes.plot(
                rounds, means, style, color=color, marker="o", ms=3, label=f"{algorithm} {label}"
            )
            if len(runs) > 1:
                low = [m - s for m, s in zip(means, stds, strict=True)]
                high = [m + s for m, s in zip(means, stds, strict=True)]
                axes.fill_between(rounds, low, high, color=color, alpha=0.15, linewidth=0)
    if not drawn:
        return False
    pretrain = max((int(r.summary.get("pretrain_rounds") or 0) for r in all_runs), default=0)
    if pretrain:
        axes.axvline(pretrain + 0.5, color="grey", linestyle=":", label="end of pretraining")
    axes.set_xlabel("round")
    _integer_axis(axes.xaxis)
    axes.set_ylabel(f"mean {all_runs[0].metric_name} over devices (own test split)")
    axes.set_title(f"{all_runs[0].metric_name} per round: {_title(all_runs)}".rstrip(": "))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2 if len(grouped) > 3 else 1)
    figure.savefig(path)
    return True


def plot_loss(grouped: dict[str, list[RunData]], path: Path) -> bool:
    """Mean training loss per round, one line per algorithm (mean over seeds)."""
    figure = _figure(8, 4.4)
    axes = figure.add_subplot()
    drawn = False
    for color, (algorithm, runs) in zip(_colors(len(grouped)), grouped.items(), strict=True):
        rounds, means, _ = curve(runs, "train_loss")
        if rounds:
            drawn = True
            axes.plot(rounds, means, color=color, marker="o", ms=3, label=algorithm)
    if not drawn:
        return False
    axes.set_xlabel("round")
    _integer_axis(axes.xaxis)
    axes.set_ylabel("mean training loss of the participants")
    axes.set_title("training loss per round")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.savefig(path)
    return True


def plot_device_histogram(grouped: dict[str, list[RunData]], path: Path) -> bool:
    """Per algorithm, the histogram over devices of personalized and global final scores.

    As in the Self-FL paper: where the personalized distribution sits right of the global one
    (for accuracy), personalization helped most devices. Seeds are pooled.
    """
    with_devices = {a: runs for a, runs in grouped.items() if any(r.devices for r in runs)}
    if not with_devices:
        return False
    figure = _panel_figure(len(with_devices))
    for axes, (algorithm, runs) in zip(
        _subplots(figure, len(with_devices)), with_devices.items(), strict=True
    ):
        devices = [device for run in runs for device in run.devices]
        personal = [d["personalized"] for d in devices if d.get("personalized") is not None]
        shared = [d["global_model"] for d in devices if d.get("global_model") is not None]
        values = personal + shared
        low, high = min(values), max(values)
        bins = [low + (high - low) * i / 15 for i in range(16)] if high > low else 10
        axes.hist(personal, bins=bins, alpha=0.6, label=f"personalized ({len(personal)})")
        if shared:
            axes.hist(shared, bins=bins, alpha=0.6, label=f"global ({len(shared)})")
        axes.set_title(algorithm)
        axes.set_xlabel(f"{runs[0].metric_name} on the device's test split")
        axes.set_ylabel("devices")
        _integer_axis(axes.yaxis)
        axes.legend(fontsize="small")
    figure.suptitle("per-device final scores: personalized against global model")
    figure.savefig(path)
    return True


def plot_gain_vs_samples(grouped: dict[str, list[RunData]], path: Path) -> bool:
    """Per algorithm, each device's gain (personalized - global) against its training samples.

    As in the partial personalization paper: devices below zero were hurt by personalizing.
    Returns False when no algorithm has a global model to compare with.
    """
    gains = {a: device_gains(runs) for a, runs in grouped.items()}
    gains = {a: points for a, points in gains.items() if points}
    if not gains:
        return False
    figure = _panel_figure(len(gains))
    for axes, (algorithm, points) in zip(_subplots(figure, len(gains)), gains.items(), strict=True):
        samples = [x for x, _ in points]
        values = [y for _, y in points]
        helped = sum(1 for y in values if y > 0)
        hurt = sum(1 for y in values if y < 0)
        colors = ["tab:green" if y > 0 else "tab:red" if y < 0 else "tab:grey" for y in values]
        axes.scatter(samples, values, c=colors, s=18, alpha=0.8)
        axes.axhline(0.0, color="black", linewidth=0.8)
        axes.set_title(f"{algorithm}: {helped} helped, {hurt} hurt")
        axes.set_xlabel("training samples on the device")
        axes.set_ylabel("gain: personalized - global")
        axes.grid(alpha=0.3)
    figure.suptitle("per-device gain of personalization against local data size")
    figure.savefig(path)
    return True


def build_report(run_dir: Path) -> Report:
    """Write every plot that the runs under `run_dir` have data for into run_dir/plots/.

    Raises:
        FileNotFoundError: `run_dir` is missing or holds no run.
    """
    runs = find_runs(run_dir)
    grouped = _by_algorithm(runs, _compare_order(run_dir))
    out_dir = run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir=out_dir, runs=len(runs), algorithms=list(grouped))
    plots = (
        (ACCURACY_PNG, plot_accuracy, "no evaluation in metrics.jsonl"),
        (LOSS_PNG, plot_loss, "no training loss in metrics.jsonl"),
        (HISTOGRAM_PNG, plot_device_histogram, "no devices.jsonl"),
        (GAIN_PNG, plot_gain_vs_samples, "no device has a global-model score"),
    )
    for name, plot, reason in plots:
        path = out_dir / name
        if plot(grouped, path):
            report.plots.append(path)
            logger.info("wrote %s", path)
        else:
            report.skipped.append(f"{name}: {reason}")
    return report
