"""Reproduce the partial-personalization paper's qualitative findings at small scale.

Spec partial-personalization.md §6.7: no dataset of the paper can be downloaded here, so the
tables run the paper's pipeline (§3.1) on the bundled `digits` (label skew, Dirichlet(0.3)) and on
`synthetic` (per-device labelling functions and input means) with `pfl-coord simulate`:

* FedAvg and FedAvg+FT for 30 rounds, and `local` (no communication) for 30 rounds;
* FedSim and FedAlt: 15 FedAvg pretraining rounds (stage a), then 15 rounds (stage b) with each
  personalization preset (output, input, adapters, all), with stateful and stateless devices,
  then the default stage c (5 epochs fine-tuning the personal part);
* FedAlt output-layer without stage c (finetune_epochs=0), stateful and stateless.

A third table is the 100-device digits setting (about a dozen samples per device), where personal
heads may overfit. Every row is the mean and std over seeds of the personalized test accuracy
(device mean and mean of the worst 10% of devices), the non-personalized model's accuracy, the
devices helped and hurt by personalization, and the payload bytes per round (stage b, median).

    OMP_NUM_THREADS=1 python -m benchmarks.personalization [--seeds 3] [--quick] [--jobs 2]
        [--tables synthetic]

The tables are written between markers in docs/results.md (the readings around them are kept);
`--quick` (one seed, 10 rounds, two tasks' main rows only) prints without writing. `--tables`
runs and rewrites only the named tables (digits, synthetic, digits-100); the timing line is
rewritten only by a full run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.common import choose, init_worker, mean_std, mean_std_cell, write_section

ROUNDS = 30
PRETRAIN = 15
LOCAL = {"local_epochs": 2, "lr": 0.1}
PRESETS = ("output", "input", "adapters", "all")
ADAPTER_WIDTH = 16


@dataclass(frozen=True)
class Setting:
    """One task setting: its simulation keyword arguments and where its table goes."""

    key: str
    title: str
    base: dict[str, Any]


@dataclass(frozen=True)
class Row:
    """One method of a table."""

    label: str
    algorithm: str
    preset: str | None = None
    stateless: bool = False
    pipeline: bool = False  # stage a (FedAvg pretraining) before the algorithm
    no_stage_c: bool = False  # finetune_epochs=0: the personal part as stage b left it

    def algorithm_options(self) -> dict[str, Any]:
        """Stage c off for the rows that ask; FedAvg+FT fine-tunes every device (the baseline)."""
        if self.algorithm == "fedavg-ft":
            return {"finetune_select": False}
        return {"finetune_epochs": 0} if self.no_stage_c else {}

    def task_options(self) -> dict[str, Any]:
        """The adapter preset needs the task's adapter model; every other row the plain one."""
        return {"adapters": ADAPTER_WIDTH} if self.preset == "adapters" else {}


SETTINGS = (
    Setting(
        "digits",
        "digits: 20 devices, Dirichlet(0.3) label skew",
        {"task": "digits", "devices": 20, "partition": "dirichlet", "alpha": 0.3},
    ),
    Setting(
        "synthetic",
        "synthetic: 30 devices, Synthetic(1, 1)",
        {"task": "synthetic", "devices": 30},
    ),
    Setting(
        "digits-100",
        "digits: 100 devices, Dirichlet(0.3), about a dozen samples per device",
        {"task": "digits", "devices": 100, "partition": "dirichlet", "alpha": 0.3},
    ),
)


def main_rows() -> list[Row]:
    """The reproduction table's rows."""
    rows = [
        Row("FedAvg", "fedavg"),
        Row("FedAvg+FT", "fedavg-ft"),
        Row("Local only", "local"),
    ]
    for algorithm, name in (("fedsim", "FedSim"), ("fedalt", "FedAlt")):
        for stateless in (False, True):
            for preset in PRESETS:
                rows.append(Row(name, algorithm, preset, stateless, pipeline=True))
    for stateless in (False, True):
        rows.append(
            Row("FedAlt, no stage c", "fedalt", "output", stateless, True, no_stage_c=True)
        )  # fmt: skip
    return rows


def small_device_rows() -> list[Row]:
    """The 100-device table's rows."""
    return [
        Row("Local only", "local"),
        Row("FedAvg", "fedavg"),
        Row("FedAvg+FT", "fedavg-ft"),
        Row("FedAlt", "fedalt", "output", False, True),
        Row("FedAlt", "fedalt", "output", True, True),
        Row("FedAlt, no stage c", "fedalt", "output", False, True, no_stage_c=True),
        Row("FedAlt, no stage c", "fedalt", "output", True, True, no_stage_c=True),
    ]


RUN_COLUMNS = ("personalized_mean", "personalized_worst10", "global", "helped", "hurt")
"""The columns of `coordinator.run.compare.run_values` a cell keeps."""


def run_one(base: dict[str, Any], row: Row, seed: int, rounds: int) -> dict[str, Any]:
    """One simulation; the numbers a table cell needs."""
    from coordinator.run.compare import run_values
    from coordinator.run.settings import SimulationSettings
    from coordinator.run.simulate import run_simulation

    stage_b = rounds - rounds // 2 if row.pipeline else rounds
    kwargs: dict[str, Any] = {
        **base,
        **LOCAL,
        "algorithm": row.algorithm,
        "rounds": stage_b,
        "pretrain_rounds": rounds // 2 if row.pipeline else 0,
        "stateless": row.stateless,
        "seed": seed,
        "algorithm_options": row.algorithm_options(),
        "task_options": row.task_options(),
    }
    if row.preset is not None:
        kwargs["personal_preset"] = row.preset
    started = time.perf_counter()
    result = run_simulation(SimulationSettings.load(None, **kwargs))
    seconds = time.perf_counter() - started
    values = run_values(result.summary)
    stage_records = result.records[-stage_b:]
    return {
        **{key: values[key] for key in RUN_COLUMNS},
        "up": statistics.median(r.bytes_up for r in stage_records),
        "down": statistics.median(r.bytes_down for r in stage_records),
        "seconds": seconds,
    }


def personal_fraction(base: dict[str, Any], row: Row) -> float | None:
    """The fraction of the model's parameters the row's preset makes personal."""
    from pfl_tasks.presets import resolve_preset
    from pfl_tasks.registry import load_task
    from pfl_tasks.split import ParamSplit

    if row.algorithm in ("local", "fedavg-ft"):
        return 1.0  # local trains, and FedAvg+FT fine-tunes, the whole model (spec §2.4)
    if row.preset is None:
        return 0.0
    model = load_task(base["task"], row.task_options()).build_model(0)
    split = ParamSplit.for_model(model, resolve_preset(row.preset, model))
    params = dict(model.named_parameters())
    personal = sum(params[n].numel() for n in split.personal if n in params)
    return personal / sum(p.numel() for p in params.values())


def _cell(values: Sequence[float | None], std: bool = True) -> str:
    return mean_std_cell(values, std=std)


def _row_name(row: Row) -> str:
    return row.label if row.preset is None else f"{row.label} {row.preset}"


def _state(row: Row) -> str:
    if row.preset is None:
        return "-"
    return "stateless" if row.stateless else "stateful"


def render(
    setting: Setting, rows: list[Row], runs: dict[Row, list[dict[str, Any]]], seeds: int
) -> str:
    """The markdown table of one setting, with its automatic checks."""
    lines = [
        "| method | devices | personal params | personalized mean | worst 10% | "
        "non-personalized model | helped / hurt | kB up / down per round | s per run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = runs[row]
        fraction = personal_fraction(setting.base, row)
        helped = mean_std([c["helped"] for c in cells])
        hurt = mean_std([c["hurt"] for c in cells])
        effect = "-" if helped is None or hurt is None else f"{helped[0]:.1f} / {hurt[0]:.1f}"
        up = statistics.fmean(c["up"] for c in cells) / 1000
        down = statistics.fmean(c["down"] for c in cells) / 1000
        lines.append(
            f"| {_row_name(row)} | {_state(row)} | "
            f"{'-' if fraction is None else f'{fraction:.1%}'} | "
            f"{_cell([c['personalized_mean'] for c in cells])} | "
            f"{_cell([c['personalized_worst10'] for c in cells])} | "
            f"{_cell([c['global'] for c in cells], std=False)} | {effect} | "
            f"{up:.1f} / {down:.1f} | {statistics.fmean(c['seconds'] for c in cells):.1f} |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(checks(rows, runs)) + f"\n\n({seeds} seeds)"


def _mean(runs: dict[Row, list[dict[str, Any]]], row: Row, key: str = "personalized_mean") -> float:
    return statistics.fmean(c[key] for c in runs[row])


def _find(rows: list[Row], algorithm: str, preset: str | None, stateless: bool = False,
          no_stage_c: bool = False) -> Row | None:  # fmt: skip
    for row in rows:
        if (row.algorithm, row.preset, row.stateless) == (algorithm, preset, stateless) and (
            row.no_stage_c == no_stage_c
        ):
            return row
    return None


def checks(rows: list[Row], runs: dict[Row, list[dict[str, Any]]]) -> list[str]:
    """The paper's qualitative findings, computed from the table (mean personalized accuracy)."""
    out: list[str] = []
    pairs = []
    for stateless in (False, True):
        for preset in PRESETS:
            alt, sim = (
                _find(rows, "fedalt", preset, stateless),
                _find(rows, "fedsim", preset, stateless),
            )
            if alt and sim:
                pairs.append((preset, stateless, _mean(runs, alt) - _mean(runs, sim)))
    if pairs:
        wins = sum(1 for *_, diff in pairs if diff >= 0)
        detail = ", ".join(f"{p}{' stateless' if s else ''} {d * 100:+.1f}" for p, s, d in pairs)
        out.append(
            f"- FedAlt - FedSim (points): {detail}; FedAlt >= FedSim in {wins}/{len(pairs)}."
        )
    fedavg = _find(rows, "fedavg", None)
    fulls = [r for r in (_find(rows, "fedalt", "all"), _find(rows, "fedavg-ft", None)) if r]
    if fedavg and fulls:
        base = _mean(runs, fedavg)
        full = max(fulls, key=lambda row: _mean(runs, row))
        top = _mean(runs, full)
        parts = []
        for preset in ("output", "input", "adapters"):
            row = _find(rows, "fedalt", preset)
            if row and top != base:
                parts.append(f"{preset} {(_mean(runs, row) - base) / (top - base):.0%}")
        out.append(
            f"- Share of full personalization's gain over FedAvg recovered by FedAlt (stateful), "
            f"against the better full method ({_row_name(full)}, {(top - base) * 100:+.1f} "
            f"points): {', '.join(parts)}."
        )
    for stateless in (False, True):
        with_c = _find(rows, "fedalt", "output", stateless)
        without = _find(rows, "fedalt", "output", stateless, no_stage_c=True)
        if with_c and without:
            gain_c = _mean(runs, with_c) - _mean(runs, without)
            out.append(
                f"- FedAlt output, {'stateless' if stateless else 'stateful'}: stage c adds "
                f"{gain_c * 100:+.1f} points ({_mean(runs, without):.3f} -> "
                f"{_mean(runs, with_c):.3f})."
            )
    out_row, in_row = _find(rows, "fedalt", "output"), _find(rows, "fedalt", "input")
    if out_row and in_row:
        diff = _mean(runs, out_row) - _mean(runs, in_row)
        out.append(f"- FedAlt output - input (stateful): {diff * 100:+.1f} points.")
    return out


def main() -> None:
    """Run every setting and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--small-seeds", type=int, default=None,
                        help="seeds of the 100-device table (default: --seeds)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 seed, 10 rounds, print only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    keys = [setting.key for setting in SETTINGS]
    parser.add_argument("--tables", help=f"comma-separated, of {', '.join(keys)} (default: all)")
    args = parser.parse_args()
    tables = choose(args.tables, keys, "table")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seeds = 1 if args.quick else args.seeds
    small_seeds = seeds if args.small_seeds is None else args.small_seeds
    rounds = 10 if args.quick else ROUNDS
    plan: list[tuple[Setting, list[Row], int]] = [
        (SETTINGS[0], main_rows(), seeds),
        (SETTINGS[1], main_rows(), seeds),
    ]
    if not args.quick:
        plan.append((SETTINGS[2], small_device_rows(), small_seeds))
    plan = [entry for entry in plan if entry[0].key in tables]
    started = time.perf_counter()
    with ProcessPoolExecutor(
        args.jobs, mp_context=get_context("spawn"), initializer=init_worker
    ) as pool:
        futures = {
            (setting.key, row, seed): pool.submit(run_one, setting.base, row, seed, rounds)
            for setting, rows, count in plan
            for row in rows
            for seed in range(count)
        }
        results = {key: future.result() for key, future in futures.items()}
    total = time.perf_counter() - started
    for setting, rows, count in plan:
        runs = {row: [results[(setting.key, row, s)] for s in range(count)] for row in rows}
        marker = f"<!-- personalization-{setting.key} -->"
        section = "\n".join(
            [
                marker,
                f"### {setting.title}",
                "",
                render(setting, rows, runs, count),
                marker,
            ]
        )
        print(section, "\n")
        if not args.quick:
            write_section(args.out, section, marker)
    timing = (
        f"<!-- personalization-timing -->\nLast full run: {total / 60:.1f} minutes with "
        f"{args.jobs} worker process{'es' if args.jobs != 1 else ''}, one torch thread each."
        "\n<!-- personalization-timing -->"
    )
    print(timing)
    if not args.quick and len(plan) == len(SETTINGS):
        write_section(args.out, timing, "<!-- personalization-timing -->")


if __name__ == "__main__":
    main()
