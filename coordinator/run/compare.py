"""`pfl-coord compare`: one workload, several algorithms and seeds, one table of mean and std."""

from __future__ import annotations

import csv
import json
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from coordinator.run.pipeline import RoundCallback
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols.algorithms import algorithm_names

logger = logging.getLogger(__name__)

# Per-run values the table reports, in column order: (key, header, kind). "metric" values are
# the task's metric (accuracy, mse), "count" devices, "bytes" bytes and "seconds" seconds.
COLUMNS: Final = (
    ("personalized_mean", "personalized mean", "metric"),
    ("personalized_worst10", "worst 10%", "metric"),
    ("personalized_top10_weighted", "top 10% weighted", "metric"),
    ("global", "global", "metric"),
    ("helped", "helped", "count"),
    ("hurt", "hurt", "count"),
    ("bytes_up_per_round", "bytes up / round", "bytes"),
    ("bytes_down_per_round", "bytes down / round", "bytes"),
    ("wall_seconds", "wall s", "seconds"),
)
COMPARISON_MD: Final = "comparison.md"
COMPARISON_CSV: Final = "comparison.csv"
RUNS_CSV: Final = "runs.csv"
COMPARISON_JSON: Final = "comparison.json"


@dataclass(frozen=True)
class RunSpec:
    """One simulation of a comparison: an algorithm, a seed and the settings to run it with."""

    algorithm: str
    seed: int
    settings: SimulationSettings


@dataclass
class RunOutcome:
    """What one run reported: its summary and the per-run values of COLUMNS.

    `summary` reads as summary.json does: a live `RunSummary`, or a summary.json loaded from a
    cache (benchmarks), so `run_values` reads both by the file's keys.
    """

    spec: RunSpec
    summary: Mapping[str, Any]
    values: dict[str, float | None]


@dataclass
class AlgorithmRow:
    """Mean and sample standard deviation over seeds of every column, for one algorithm."""

    algorithm: str
    runs: int
    mean: dict[str, float | None] = field(default_factory=dict)
    std: dict[str, float | None] = field(default_factory=dict)


@dataclass
class Comparison:
    """Every run's outcome and the per-algorithm table, with the files written."""

    out: Path
    runs: list[RunOutcome]
    rows: list[AlgorithmRow]
    files: list[Path]


def parse_algorithms(text: str | Sequence[str]) -> list[str]:
    """Algorithm names from "a,b,c" (or a list), checked against the registry, order kept.

    Raises:
        ValueError: no name, a repeated name, or an unknown one (the message lists valid names).
    """
    raw = text.split(",") if isinstance(text, str) else list(text)
    names = [name.strip() for name in raw if name.strip()]
    valid = algorithm_names()
    unknown = [name for name in names if name not in valid]
    if unknown:
        msg = f"unknown algorithm(s) {', '.join(unknown)}; choose from: {', '.join(valid)}"
        raise ValueError(msg)
    if not names:
        msg = f"no algorithm given; choose from: {', '.join(valid)}"
        raise ValueError(msg)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        msg = f"algorithm(s) given twice: {', '.join(repeated)}"
        raise ValueError(msg)
    return names


def parse_seeds(text: str | int) -> list[int]:
    """Seeds from a count ("3": seeds 0, 1, 2) or a comma-separated list ("0,5,7").

    Raises:
        ValueError: not a positive count or a list of distinct non-negative integers.
    """
    value = str(text).strip()
    try:
        if "," not in value:
            count = int(value)
            if count < 1:
                msg = f"--seeds must be a positive count or a list like 0,1,2, not {value!r}"
                raise ValueError(msg)
            return list(range(count))
        seeds = [int(part) for part in value.split(",") if part.strip()]
    except ValueError as error:
        if "--seeds" in str(error):
            raise
        msg = f"--seeds must be a positive count or a list like 0,1,2, not {value!r}"
        raise ValueError(msg) from None
    if not seeds or any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        msg = f"--seeds must be a positive count or a list of distinct seeds >= 0, not {value!r}"
        raise ValueError(msg)
    return seeds


def default_eval_every(settings: SimulationSettings) -> int:
    """About ten evaluations per run: max(1, (pretrain_rounds + rounds) // 10)."""
    return max(1, (settings.pretrain_rounds + settings.rounds) // 10)


def plan_runs(
    algorithms: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    config: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> list[RunSpec]:
    """Settings of every run, algorithm-major; each writes into out/<algorithm>/seed-<s>/.

    `overrides` are simulate's settings (None meaning "not given"). When neither they nor the
    config file or environment set `eval_every`, it becomes `default_eval_every`, so every run
    records accuracy per round.

    Raises:
        ValueError: an unknown algorithm or an invalid setting (checked before any run starts).
        FileNotFoundError: `config` does not exist.
    """
    names = parse_algorithms(list(algorithms))
    values = {k: v for k, v in (overrides or {}).items() if k not in ("algorithm", "seed", "out")}
    specs = []
    for name in names:
        for seed in seeds:
            settings = SimulationSettings.load(
                config, **values, algorithm=name, seed=seed, out=out / name / f"seed-{seed}"
            )
            if settings.eval_every == 0:
                settings = settings.model_copy(update={"eval_every": default_eval_every(settings)})
            settings.algorithm_config()  # invalid hyperparameters fail before the first run
            specs.append(RunSpec(algorithm=name, seed=seed, settings=settings))
    return specs


def run_values(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The values of COLUMNS for one run, from its summary (as in summary.json)."""
    metrics = summary.get("metrics") or {}
    effect = summary.get("personalization") or {}
    rounds = max(1, int(summary.get("rounds") or 1))
    return {
        "personalized_mean": metrics.get("personalized_mean"),
        "personalized_worst10": metrics.get("personalized_worst10"),
        "personalized_top10_weighted": metrics.get("personalized_top10_weighted"),
        "global": metrics.get("global"),
        "helped": effect.get("helped"),
        "hurt": effect.get("hurt"),
        "bytes_up_per_round": summary["bytes_up"] / rounds,
        "bytes_down_per_round": summary["bytes_down"] / rounds,
        "wall_seconds": summary["wall_seconds"],
    }


def aggregate(outcomes: Sequence[RunOutcome]) -> list[AlgorithmRow]:
    """Per algorithm (in run order), mean and sample std (n-1) over its seeds of each column.

    A column some run lacks (e.g. `global` of `local`) is None; std is None with one seed.
    """
    rows: dict[str, AlgorithmRow] = {}
    grouped: dict[str, list[RunOutcome]] = {}
    for outcome in outcomes:
        grouped.setdefault(outcome.spec.algorithm, []).append(outcome)
    for name, runs in grouped.items():
        row = AlgorithmRow(algorithm=name, runs=len(runs))
        for key, _, _ in COLUMNS:
            values = [run.values[key] for run in runs]
            present = [float(v) for v in values if v is not None and math.isfinite(v)]
            if len(present) != len(values) or not present:
                row.mean[key], row.std[key] = None, None
                continue
            row.mean[key] = statistics.fmean(present)
            row.std[key] = statistics.stdev(present) if len(present) > 1 else None
        rows[name] = row
    return list(rows.values())


def run_comparison(
    specs: Sequence[RunSpec],
    out: Path,
    *,
    on_run_start: Callable[[RunSpec], None] | None = None,
    on_run_end: Callable[[RunOutcome], None] | None = None,
    on_round: RoundCallback | None = None,
) -> Comparison:
    """Run every planned simulation in turn and write the comparison files into `out`.

    Files: comparison.md (markdown table, "mean ± std" cells), comparison.csv (one row per
    algorithm, `<column>_mean` and `<column>_std`), runs.csv (one row per run) and
    comparison.json (the same, machine-readable, with the shared settings).

    Raises:
        ValueError, RoundError: a run failed; the runs before it keep their run directories.
    """
    out.mkdir(parents=True, exist_ok=True)
    outcomes: list[RunOutcome] = []
    for spec in specs:
        if on_run_start is not None:
            on_run_start(spec)
        logger.info("compare: %s seed %d", spec.algorithm, spec.seed)
        result = run_simulation(spec.settings, on_round=on_round)
        outcome = RunOutcome(spec=spec, summary=result.summary, values=run_values(result.summary))
        outcomes.append(outcome)
        if on_run_end is not None:
            on_run_end(outcome)
    rows = aggregate(outcomes)
    files = write_comparison(out, specs, outcomes, rows)
    return Comparison(out=out, runs=outcomes, rows=rows, files=files)


def _workload(specs: Sequence[RunSpec], outcomes: Sequence[RunOutcome]) -> dict[str, Any]:
    first = specs[0].settings
    metric = outcomes[0].summary.get("metric_name", "metric") if outcomes else "metric"
    return {
        "task": first.task,
        "devices": first.devices,
        "rounds": first.rounds,
        "pretrain_rounds": first.pretrain_rounds,
        "partition": first.partition,
        "alpha": first.alpha,
        "participation": first.participation,
        "eval_every": first.eval_every,
        "seeds": sorted({spec.seed for spec in specs}),
        "metric_name": metric,
    }


def _cell(mean: float | None, std: float | None, kind: str) -> str:
    if mean is None:
        return "n/a"
    formats = {"metric": "{:.3f}", "count": "{:.1f}", "bytes": "{:,.0f}", "seconds": "{:.1f}"}
    text = formats[kind].format(mean)
    return text if std is None else f"{text} ± {formats[kind].format(std)}"


def format_cells(row: AlgorithmRow) -> list[str]:
    """The row's COLUMNS as "mean ± std" text (or "n/a"), formatted by kind."""
    return [_cell(row.mean[key], row.std[key], kind) for key, _, kind in COLUMNS]


def render_markdown(
    workload: Mapping[str, Any], rows: Sequence[AlgorithmRow], runs_per_algorithm: int
) -> str:
    """The comparison as a markdown table, one row per algorithm, "mean ± std" over seeds."""
    seeds = ", ".join(str(seed) for seed in workload["seeds"])
    lines = [
        f"# Comparison on {workload['task']}",
        "",
        f"{workload['devices']} devices, {workload['partition']} partition "
        f"(alpha {workload['alpha']:g}), {workload['pretrain_rounds']} pretraining + "
        f"{workload['rounds']} rounds, participation {workload['participation']:g}; "
        f"mean ± std (sample, n-1) over seeds {seeds}. Metric: {workload['metric_name']} on "
        "each device's own test split; helped/hurt: devices whose personalized model beat or "
        "lost to the global one.",
        "",
        "| algorithm | runs | " + " | ".join(header for _, header, _ in COLUMNS) + " |",
        "|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append(f"| {row.algorithm} | {row.runs} | " + " | ".join(format_cells(row)) + " |")
    if any(row.runs != runs_per_algorithm for row in rows):
        lines += ["", "Some algorithms have fewer runs than seeds."]
    return "\n".join(lines) + "\n"


def write_comparison(
    out: Path,
    specs: Sequence[RunSpec],
    outcomes: Sequence[RunOutcome],
    rows: Sequence[AlgorithmRow],
) -> list[Path]:
    """Write comparison.md, comparison.csv, runs.csv and comparison.json; return their paths."""
    workload = _workload(specs, outcomes)
    paths = [out / name for name in (COMPARISON_MD, COMPARISON_CSV, RUNS_CSV, COMPARISON_JSON)]
    markdown, table, per_run, document = paths
    markdown.write_text(render_markdown(workload, rows, len(workload["seeds"])))
    keys = [key for key, _, _ in COLUMNS]
    with table.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["algorithm", "runs", *(f"{k}_{s}" for k in keys for s in ("mean", "std"))])
        for row in rows:
            cells = [
                row.mean[k] if s == "mean" else row.std[k] for k in keys for s in ("mean", "std")
            ]
            writer.writerow([row.algorithm, row.runs, *("" if c is None else c for c in cells)])
    with per_run.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["algorithm", "seed", "run_dir", *keys])
        for outcome in outcomes:
            writer.writerow(
                [
                    outcome.spec.algorithm,
                    outcome.spec.seed,
                    str(outcome.spec.settings.out),
                    *("" if outcome.values[k] is None else outcome.values[k] for k in keys),
                ]
            )
    document.write_text(
        json.dumps(
            {
                "workload": workload,
                "algorithms": [
                    {"algorithm": r.algorithm, "runs": r.runs, "mean": r.mean, "std": r.std}
                    for r in rows
                ],
                "runs": [
                    {
                        "algorithm": o.spec.algorithm,
                        "seed": o.spec.seed,
                        "run_dir": str(o.spec.settings.out),
                        "values": o.values,
                    }
                    for o in outcomes
                ],
            },
            indent=2,
            sort_keys=True,
        )
    )
    return paths
