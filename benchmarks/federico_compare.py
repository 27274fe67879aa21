"""Reproduce FedeRiCo's comparison with local training, FedAvg and FedAvg+FT at small scale.

federico.md §5.6: CIFAR and Office-Home cannot be run here, so the comparison runs the spec's
two stand-ins through `pfl-coord simulate`, one simulation at a time:

* `sine` (generator §5.1: 8 devices, 4 intervals, 20 train points, noise 0.1), 300 rounds: local
  (SGD, defaults), FedAvg, FedAvg+FT (defaults), FedeRiCo at its default Adam 0.03 with the
  E-step on the training split (Alg. 1) and on the validation split, and the oracle (least
  squares on the pooled training data of each device's interval, in numpy); then an M sweep
  of FedeRiCo.
* `digits` label groups (the Table-1 protocol, §5.1): 8 devices, D in {2, 3, 4} groups, a 25%
  subsample, softmax regression, 150 rounds. The SGD baselines run at lr 0.5 (the default 0.1
  leaves FedAvg under-trained in 150 rounds); FedeRiCo at the paper's Adam 0.01 (the default
  0.03 lands within noise of it there: 95.3% against 95.4% over D in {2, 3, 4} and seeds 0-1).

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.federico_compare [--sine-seeds 5]
        [--digits-seeds 5] [--sweep-seeds 3] [--save runs.json | --load runs.json] [--quick]

The tables are written between the `<!-- federico -->` markers of docs/results.md; `--quick`
(one seed, 20 rounds) prints without writing. `--load` renders saved runs without simulating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import init_worker, markdown_table, mean_std_cell, write_section

MARKER = "<!-- federico -->"
COMMAND = "OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.federico_compare"
SINE: dict[str, Any] = {"task": "sine", "devices": 8, "rounds": 300}
DIGITS: dict[str, Any] = {
    "task": "digits",
    "devices": 8,
    "rounds": 150,
    "partition": "groups",
    "fraction": 0.25,
    "task_options": {"model": "linear"},
}
GROUPS = (2, 3, 4)
SWEEP_M = (0, 1, 3, 7)
SGD_LR_DIGITS = 0.5


@dataclass(frozen=True)
class Row:
    """One method of a table: its label, algorithm and settings beyond the task's."""

    label: str
    algorithm: str
    options: dict[str, Any] = field(default_factory=dict)
    prototype: str = "-"  # spec §5.6's numpy prototype (sine MSE), where it has one

    def kwargs(self, base: dict[str, Any], seed: int, **extra: Any) -> dict[str, Any]:
        """The simulation's keyword arguments."""
        return {**base, **self.options, **extra, "algorithm": self.algorithm, "seed": seed}


FEDERICO_SINE = {"lr": 0.03}  # the default since it was measured here
PAPER_LR = {"lr": 0.01}  # the digits rows were measured at the paper's Adam step
VALIDATION = {"algorithm_options": {"estep_data": "validation"}}
SINE_ROWS = (
    Row("Local (SGD 0.1, defaults)", "local", {}, "0.0412 ± 0.0046 (Adam 0.01)"),
    Row("FedAvg", "fedavg", {}, "0.2066 ± 0.0056"),
    Row("FedAvg+FT", "fedavg-ft", {}, "-"),
    Row(
        "FedeRiCo (defaults: Adam 0.03, E-step on train)",
        "federico",
        FEDERICO_SINE,
        "0.0179 ± 0.0017",
    ),
    Row("FedeRiCo (Adam 0.03, E-step on validation)", "federico", {**FEDERICO_SINE, **VALIDATION}),
)
SGD_DIGITS = {"lr": SGD_LR_DIGITS}
DIGITS_ROWS = (
    Row("Local (SGD 0.5)", "local", SGD_DIGITS),
    Row("FedAvg (SGD 0.5)", "fedavg", SGD_DIGITS),
    Row("FedAvg+FT (SGD 0.5, FT 3 epochs at 0.02)", "fedavg-ft", SGD_DIGITS),
    Row("FedeRiCo (Adam 0.01 as the paper, E-step on train)", "federico", PAPER_LR),
    Row("FedeRiCo (Adam 0.01, E-step on validation)", "federico", {**PAPER_LR, **VALIDATION}),
)
SWEEP_PROTOTYPE = {0: "0.0412 (= its local)", 1: "0.0188", 3: "0.0179", 7: "0.0221"}
# fmt: off
PAPER_COLUMNS = ("C10 D=2", "C10 D=3", "C10 D=4", "C100 D=2", "C100 D=3", "C100 D=4",
                 "OH D=2", "OH D=3", "OH D=4")
PAPER_TABLE1 = (  # spec §5.5 Table 1 [P], accuracy (%), std across runs
    ("FedAvg", "11.44 ± 3.28", "11.73 ± 3.68", "13.93 ± 5.74", "21.28 ± 5.04", "17.41 ± 3.27",
     "18.36 ± 3.68", "66.58 ± 1.88", "53.36 ± 4.21", "51.25 ± 4.37"),
    ("FedAvg+", "12.45 ± 8.46", "29.86 ± 17.85", "45.65 ± 21.61", "29.95 ± 1.07", "35.33 ± 1.77",
     "36.17 ± 3.27", "80.21 ± 0.68", "81.88 ± 0.91", "84.50 ± 1.37"),
    ("Local Training", "40.09 ± 2.84", "55.27 ± 3.11", "69.03 ± 7.05", "16.60 ± 0.64",
     "25.99 ± 2.38", "31.05 ± 1.68", "76.76 ± 0.23", "83.30 ± 0.32", "88.05 ± 0.44"),
    ("**FedeRiCo**", "**56.61 ± 2.51**", "**69.76 ± 2.25**", "**78.22 ± 4.80**",
     "**30.95 ± 1.62**", "**39.19 ± 1.64**", "**41.41 ± 1.07**", "**83.56 ± 0.49**",
     "**90.28 ± 0.75**", "**93.76 ± 0.12**"),
)
# fmt: on
PROTOTYPE_DIGITS = (  # spec §5.6 [X]: numpy, FedAvg with server Adam, pooled accuracy, 5 seeds
    ("D=2", "94.18 ± 1.60", "95.74 ± 1.64", "92.83 ± 1.49", "**95.98 ± 1.65**"),
    ("D=3", "95.11 ± 2.20", "97.56 ± 1.64", "96.03 ± 1.60", "**98.45 ± 1.13**"),
    ("D=4", "94.04 ± 2.17", "98.02 ± 0.81", "98.02 ± 1.28", "**99.12 ± 0.44**"),
)
NOTES = """Notes on the setting:

* Our `local` is SGD (lr 0.1, batch 10, one epoch per round) run to convergence over 300 rounds.
  It is a much stronger baseline than the prototype's local (Adam 0.01, not converged in 300
  steps: 0.0412), so the FedeRiCo-vs-local margin here is measured against a converged local
  line, not against the prototype's number. Nothing was tuned to widen it.
* M = 0 is local training **with Adam** at FedeRiCo's lr (unseen models masked), not the SGD
  `local` row: the two differ only by the optimiser.
* Bytes are the payload bytes all devices sent (up) and received (down) over the whole run
  (plans, models, contributions, evaluation), divided by the rounds; `local` still moves the
  round plans and reports. FedeRiCo relays whole peer models (M + 1 per device and direction).
* digits: each device's split is the task's 65/10/25 (train/validation/test), not the paper's
  80/20. Most devices test on 7 to 17 images (a device alone in its group on up to about 50),
  so one image moves a device by 6 to 14 points; the accuracy is the unweighted device mean
  (the paper's is sample-weighted). The validation E-step sees 3 to 7 images on most devices.
  FedAvg+FT fine-tunes at its defaults (3 epochs at lr 0.02).
  The SGD lr 0.5 was picked on seeds 0 and 1 (FedAvg at 0.1 reached 79–89%, at 0.5 91–92%)."""


def simulate(kwargs: dict[str, Any]) -> dict[str, float]:
    """One simulation's final personalized metric, bytes per round and wall seconds."""
    from coordinator.run.compare import run_values
    from coordinator.run.settings import SimulationSettings
    from coordinator.run.simulate import run_simulation

    values = run_values(run_simulation(SimulationSettings.load(None, **kwargs)).summary)
    columns = {
        "mean": "personalized_mean",
        "worst": "personalized_worst10",
        "up": "bytes_up_per_round",
        "down": "bytes_down_per_round",
        "seconds": "wall_seconds",
    }
    row: dict[str, float] = {}
    for key, column in columns.items():
        value = values[column]
        if value is None:
            msg = f"the run reported no {column}"
            raise RuntimeError(msg)
        row[key] = value
    return row


def oracle(seed: int) -> dict[str, float]:
    """Spec §5.1's oracle: per interval, least squares on the pooled training points, in numpy."""
    from pfl_tasks.base import PartitionSpec
    from pfl_tasks.registry import load_task

    fleet = load_task("sine").make_fleet(SINE["devices"], PartitionSpec(), seed)

    def design(x: np.ndarray) -> np.ndarray:
        return np.hstack([x, np.ones_like(x)])

    lines = {}
    for interval in {int(d.truth["interval"]) for d in fleet}:
        pooled = [d.train for d in fleet if d.truth["interval"] == interval]
        x = np.vstack([s.inputs.numpy() for s in pooled]).astype(np.float64)
        y = np.vstack([s.targets.numpy() for s in pooled]).astype(np.float64)
        lines[interval] = np.linalg.lstsq(design(x), y, rcond=None)[0]
    mse = [
        float(
            np.mean(
                (
                    design(d.test.inputs.numpy()) @ lines[int(d.truth["interval"])]
                    - d.test.targets.numpy()
                )
                ** 2
            )
        )
        for d in fleet
    ]
    return {"mean": float(np.mean(mse)), "worst": max(mse)}  # worst ceil(10%) of 8 = 1 device


class Runs:
    """Simulations by their keyword arguments: each distinct setting runs once, in order."""

    def __init__(self, saved: dict[str, dict[str, float]], simulate_missing: bool) -> None:
        self.done = dict(saved)
        self.simulate_missing = simulate_missing

    def get(self, kwargs: dict[str, Any]) -> dict[str, float]:
        """The run's numbers, simulated now unless already done (or saved).

        Raises:
            ValueError: the run is missing from the saved runs and simulating is off.
        """
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self.done:
            if not self.simulate_missing:
                msg = f"no saved run for {key}; run without --load"
                raise ValueError(msg)
            self.done[key] = simulate(kwargs)
            print(f"{len(self.done):3d} {self.done[key]['seconds']:5.1f}s {key}", flush=True)
        return self.done[key]


def _stat(cells: Sequence[dict[str, float]], key: str, scale: float = 1.0, digits: int = 4) -> str:
    return mean_std_cell([c[key] for c in cells], scale=scale, digits=digits)


def _traffic(cells: Sequence[dict[str, float]]) -> str:
    up, down = (statistics.fmean(c[k] for c in cells) / 1000 for k in ("up", "down"))
    return f"{up:.1f} / {down:.1f} | {statistics.fmean(c['seconds'] for c in cells):.1f}"


def _mean(cells: Sequence[dict[str, float]]) -> float:
    return statistics.fmean(c["mean"] for c in cells)


def sine_section(runs: Runs, seeds: int, sweep_seeds: int, rounds: int) -> list[str]:
    """The sine table, the M sweep and the computed comparisons."""
    base = {**SINE, "rounds": rounds}
    cells = {row.label: [runs.get(row.kwargs(base, s)) for s in range(seeds)] for row in SINE_ROWS}
    best = [oracle(s) for s in range(seeds)]
    lines = [
        f"### sine: 8 devices, 4 intervals, {rounds} rounds, {seeds} seeds, test MSE",
        "",
        "| method | MSE (mean ± std) | worst device | kB up / down per round | s per run "
        "| numpy prototype |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in SINE_ROWS:
        runs_of = cells[row.label]
        lines.append(
            f"| {row.label} | {_stat(runs_of, 'mean')} | {_stat(runs_of, 'worst')} | "
            f"{_traffic(runs_of)} | {row.prototype} |"
        )
    lines += [
        f"| Oracle (pooled least squares per interval, numpy) | {_stat(best, 'mean')} | "
        f"{_stat(best, 'worst')} | - | - | 0.0145 ± 0.0010 |",
        "",
        f"M sweep (FedeRiCo, Adam 0.03, E-step on train, {sweep_seeds} seeds; M = 3 is the row "
        "above on its first seeds):",
        "",
        "| M | MSE (mean ± std) | worst device | kB up / down per round | s per run "
        "| prototype (10 seeds) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    sweep = {}
    for m in SWEEP_M:  # M = 3 is the default: the same settings (and runs) as the row above
        options = (
            FEDERICO_SINE if m == 3 else {**FEDERICO_SINE, "algorithm_options": {"neighbours": m}}
        )
        row = Row(f"M={m}", "federico", options)
        sweep[m] = [runs.get(row.kwargs(base, s)) for s in range(sweep_seeds)]
        lines.append(
            f"| {m} | {_stat(sweep[m], 'mean')} | {_stat(sweep[m], 'worst')} | "
            f"{_traffic(sweep[m])} | {SWEEP_PROTOTYPE[m]} |"
        )
    local, fedavg = _mean(cells[SINE_ROWS[0].label]), _mean(cells[SINE_ROWS[1].label])
    federico, validation = (_mean(cells[row.label]) for row in SINE_ROWS[3:])
    paired = [
        loc["mean"] - f["mean"]
        for f, loc in zip(cells[SINE_ROWS[3].label], cells[SINE_ROWS[0].label], strict=True)
    ]
    wins = sum(gain > 0 for gain in paired)
    lines += [
        "",
        f"- Expected (FedeRiCo < Local < FedAvg, FedeRiCo ≲ 0.025): FedeRiCo "
        f"{federico:.4f}, local {local:.4f}, FedAvg {fedavg:.4f}; FedeRiCo < local: "
        f"{'yes' if federico < local else 'no'} (ahead in {wins} of {seeds} seeds; local minus "
        f"FedeRiCo, paired by seed: {mean_std_cell(paired, digits=4)}), local < FedAvg: "
        f"{'yes' if local < fedavg else 'no'}, "
        f"FedeRiCo ≤ 0.025: {'yes' if federico <= 0.025 else 'no'}. FedeRiCo is "
        f"{federico / _mean(best):.2f}x the oracle's MSE (prototype: 1.23x).",
        f"- E-step on validation instead of train: {validation:.4f} vs {federico:.4f}.",
        f"- M = 0 (local training with Adam, masked) {_mean(sweep[0]):.4f} vs the SGD local "
        f"{_mean(cells[SINE_ROWS[0].label][:sweep_seeds]):.4f} on the same {sweep_seeds} seeds; "
        "M >= 1 minus M = 0: "
        + ", ".join(f"M={m} {_mean(sweep[m]) - _mean(sweep[0]):+.4f}" for m in SWEEP_M[1:])
        + ".",
    ]
    return lines


def digits_section(runs: Runs, seeds: int, rounds: int) -> list[str]:
    """The label-group table (accuracy % per D) and the computed comparisons."""
    base = {**DIGITS, "rounds": rounds}
    cells = {
        (row.label, d): [runs.get(row.kwargs(base, s, groups=d)) for s in range(seeds)]
        for row in DIGITS_ROWS
        for d in GROUPS
    }
    lines = [
        f"### digits label groups: 8 devices, 25% subsample, softmax regression, {rounds} rounds,"
        f" {seeds} seeds, accuracy (%)",
        "",
        "| method | " + " | ".join(f"D={d}" for d in GROUPS) + " | kB up / down per round "
        "| s per run |",
        "|---|" + "---:|" * (len(GROUPS) + 2),
    ]
    for row in DIGITS_ROWS:
        every = [c for d in GROUPS for c in cells[(row.label, d)]]
        lines.append(
            f"| {row.label} | "
            + " | ".join(_stat(cells[(row.label, d)], "mean", 100, 1) for d in GROUPS)
            + f" | {_traffic(every)} |"
        )
    lines.append("")
    for d in GROUPS:
        means = {row.label: 100 * _mean(cells[(row.label, d)]) for row in DIGITS_ROWS}
        federico = cells[(DIGITS_ROWS[3].label, d)]
        gains = []
        for row in DIGITS_ROWS[:3]:
            baseline = cells[(row.label, d)]
            paired = [f["mean"] - b["mean"] for f, b in zip(federico, baseline, strict=True)]
            wins = sum(gain > 0 for gain in paired)
            gain = mean_std_cell(paired, scale=100, digits=1)
            gains.append(f"{row.label.split(' (')[0]} {gain} (ahead in {wins}/{seeds})")
        lines.append(
            f"- D={d}: FedeRiCo (Adam 0.01) minus each baseline, points paired by seed: "
            + ", ".join(gains)
            + f"; best row: {max(means, key=lambda label: means[label])}."
        )
    return lines


def render(sine: list[str], digits: list[str], wall_s: float, readings: str) -> str:
    """The whole marker section."""
    return "\n".join(
        [
            MARKER,
            "## FedeRiCo",
            "",
            "FedeRiCo against local training, FedAvg and FedAvg+FT on two CPU stand-ins for the "
            f"paper's experiments, with communication per round: `{COMMAND}`. "
            "Every number is the final round's, mean ± std over seeds (std across runs, as in "
            "the paper's Table 1). The paper's CIFAR/Office-Home numbers cannot be run here; "
            "they are quoted below for the ordering only.",
            "",
            *sine,
            "",
            *digits,
            "",
            "### The paper (Table 1, CIFAR-10/100 and Office-Home) and an independent numpy "
            "prototype",
            "",
            "The methods compared here (the paper also has Clustered FL, FedEM and FedFomo; "
            "FedeRiCo is best in every column):",
            "",
            *markdown_table(("paper Table 1 (%)", *PAPER_COLUMNS), PAPER_TABLE1),
            "",
            "The numpy prototype on digits (its own FedAvg with a server Adam, pooled "
            "accuracy, 5 seeds):",
            "",
            *markdown_table(
                ("prototype (%)", "FedAvg", "FedAvg+", "Local", "FedeRiCo"), PROTOTYPE_DIGITS
            ),
            "",
            NOTES,
            "",
            readings,
            "",
            f"Whole run: {wall_s / 60:.1f} min, one simulation at a time, one torch thread.",
            MARKER,
        ]
    )


READINGS = """Readings of the recorded run (5 seeds each; a rerun replaces the tables and the
computed lines, not these words):

* **Reproduced on sine: the ordering and the level.** FedeRiCo < local < FedAvg, and FedeRiCo
  (0.0162 ± 0.0010) sits at 1.11x the oracle (0.0146; the prototype's oracle is 0.0145),
  slightly below the prototype's 0.0179. FedAvg's single line (0.225) fits no device, as in the
  prototype (0.207).
* **Not reproduced on sine: a large margin over local.** The prototype's 2.3x gap to local
  (0.0179 vs 0.0412) came from an Adam 0.01 local that had not converged. Our SGD local
  converges (0.0167), and FedeRiCo beats it by 0.0005 ± 0.0004 MSE paired by seed (4 of 5
  seeds): a consistent but tiny gain, half of either method's seed-to-seed std (0.001). With
  20 points and 2 parameters per device, there is little left for collaborators to add. The M
  sweep says the same: M = 0 (Adam at 0.03, converged) is 0.0175, every M >= 1 is 0.0160 to
  0.0164 and indistinguishable from the others, while the traffic grows linearly with M
  (10.1 / 17.0 kB per round at M = 1, 28.5 / 36.1 at M = 7). "M = 1 already gives most of the
  benefit" holds; the benefit is small here.
* **The held-out E-step (`estep_data = "validation"`) is worse on sine**: 0.056 ± 0.025,
  worst device 0.135, against 0.016 on the training split. Not investigated further; one
  candidate is that the summed loss over 10 validation points gives a flatter posterior than
  over 20 training points, so weights leak onto other intervals' lines. On digits the two are
  equal within noise.
* **Reproduced on digits: FedeRiCo is the best row at every D** (95.5 / 97.9 / 96.1 %), and
  beats FedAvg and FedAvg+FT in 4 or 5 of 5 seeds at every D (by 3.0 to 6.3 points paired).
  Against local it separates only at D = 2 (+7.5 ± 2.7, 5/5 seeds); at D = 3 and D = 4, where
  each group has few labels and local is strong, it wins 3 of 5 seeds (+2.9 ± 3.5, +1.0 ± 2.4):
  within noise. The paper's trend is there: local gains with D (88 → 95 %) while FedAvg stays
  flat (92 %). FedAvg does not collapse as on CIFAR (paper: 11–14 %): the linear task is too
  easy, as the numpy prototype found. FedeRiCo lands 0.5 to 3 points below the prototype's
  numbers and every baseline 1 to 5.5 below its counterpart (the prototype's FedAvg steps with
  a server Adam, its FedAvg+ fine-tunes a full epoch; split and metric differ too, see notes).
* **Communication:** FedeRiCo relays M + 1 = 4 whole models per device and direction. Per
  round it moves 3.9x / 3.4x FedAvg's bytes up / down on digits (99 / 107 kB against 25.5 /
  31.6 kB) and 3.4x / 2.2x on sine (15.8 / 23.4 kB against 4.6 / 10.6 kB).
* **Not run:** CIFAR-10/100 and Office-Home (no download here, hours per run on CPU), so
  none of the paper's Table 1 numbers or its large gaps (e.g. +16.5 points over local on CIFAR-10
  D = 2) are reproduced or contradicted here."""


def main() -> None:
    """Run (or load) every cell, then write (or print) the section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sine-seeds", type=int, default=5)
    parser.add_argument("--digits-seeds", type=int, default=5)
    parser.add_argument("--sweep-seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 seed, 20 rounds, print only")
    parser.add_argument("--save", type=Path, help="write every run's numbers here (JSON)")
    parser.add_argument("--load", type=Path, help="render these saved runs; simulate no more")
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    args = parser.parse_args()
    init_worker()
    saved = json.loads(args.load.read_text()) if args.load else {}
    runs = Runs(saved.get("runs", {}), simulate_missing=args.load is None)
    seeds = (1, 1, 1) if args.quick else (args.sine_seeds, args.digits_seeds, args.sweep_seeds)
    started = time.perf_counter()
    sine = sine_section(runs, seeds[0], seeds[2], 20 if args.quick else SINE["rounds"])
    digits = digits_section(runs, seeds[1], 20 if args.quick else DIGITS["rounds"])
    wall_s = saved.get("wall_s", time.perf_counter() - started)
    if args.save:
        args.save.write_text(json.dumps({"runs": runs.done, "wall_s": wall_s}, indent=1))
    section = render(sine, digits, wall_s, READINGS)
    print(section)
    if not args.quick:
        write_section(args.out, section, MARKER)


if __name__ == "__main__":
    main()
