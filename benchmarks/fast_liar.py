"""A fast liar in asynchronous rounds: the fleet's fastest device lies, with the fair share or not.

With a buffer of 2 a device that answers first lands in many aggregations; each one is within
the guard's bounds, the run is not. Every run: FedAvg-FT on digits, 10 virtual devices, one
liar (`--attack-speed fastest`: it holds the fleet's top speed), 60 aggregations of 2 updates,
speeds lognormal over 10x and 0.1 simulated seconds of latency per job (training time dominates).
Accuracy is over the 9 honest devices; simulated seconds are those the 60 aggregations took
(the fair share's cost on an honest fleet: the slower devices fill the slots fast ones would
have). The table goes into docs/results.md (its "Robustness" section).

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.fast_liar [--seeds 0,1] [--print-only]
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.common import markdown_table, one_thread, write_section
from coordinator.engine.metrics import summarize_evaluations
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import device_name, run_simulation
from device_agent.attacks import AttackPlan

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- fast-liar -->"
DEVICES: Final = 10
RUN: Final[dict[str, Any]] = {
    "task": "digits",
    "algorithm": "fedavg-ft",
    "devices": DEVICES,
    "workers": 1,
    "mode": "async",
    "rounds": 60,
    "buffer": 2,
    "sim_speeds": "lognormal:10",
    "sim_latency": 0.1,
}
ATTACKS: Final = ("none", "sign-flip", "scaling")
COLUMNS: Final[dict[str, dict[str, Any]]] = {
    "--fair-share 0 (before)": {"fair_share": 0.0},
    "--fair-share 2 (default)": {"fair_share": 2.0},
    "sync, 12 rounds (reference)": {"mode": "sync", "rounds": 12},
}
"""The reference: every device once a round, 120 updates as in 60 aggregations of 2, so the
liar holds exactly its fair share."""


@dataclass(frozen=True)
class Cell:
    """One run: final accuracy over the honest devices, and the simulated time it took."""

    personalized: float
    global_model: float
    sim_seconds: float


def run_cell(attack: str, column: str, seed: int) -> Cell:
    """One simulated run; `attack` "none" is the clean run."""
    values = {**RUN, "seed": seed, **COLUMNS[column]}
    liars: frozenset[int] = frozenset()
    if attack != "none":
        values.update(attack=attack, malicious_fraction=0.1, attack_speed="fastest")
        liars = AttackPlan.draw(attack, 0.1, DEVICES, seed, None).malicious  # type: ignore[arg-type]
    honest = {device_name(i) for i in range(DEVICES) if i not in liars}
    result = run_simulation(SimulationSettings.load(None, **values))
    metrics = summarize_evaluations([r for r in result.reports if r.device_id in honest])
    return Cell(
        personalized=metrics["personalized_mean"] or float("nan"),
        global_model=metrics["global"] or float("nan"),
        sim_seconds=result.records[-1].sim_seconds or float("nan"),
    )


def render_section(cells: dict[tuple[str, str], list[Cell]], seeds: Sequence[int]) -> str:
    """The fast-liar table: per attack, off against on and the sync reference, seed means."""
    command = "python -m benchmarks.fast_liar --seeds " + ",".join(map(str, seeds))
    rows = []
    for attack in ATTACKS:
        row = [attack]
        for column in COLUMNS:
            runs = cells[attack, column]
            personal = statistics.fmean(c.personalized for c in runs)
            shared = statistics.fmean(c.global_model for c in runs)
            seconds = statistics.fmean(c.sim_seconds for c in runs)
            row.append(f"{personal:.3f} / {shared:.3f} ({seconds:.1f} s)")
        rows.append(row)
    header = ["liar (the fastest of 10)", *COLUMNS]
    return "\n".join(
        [
            MARKER,
            "<!-- written by benchmarks/fast_liar.py; do not edit -->",
            f"**A fast liar, async, buffer 2** (`{command}`,",
            f"means over {len(seeds)} seeds): FedAvg-FT on digits, {DEVICES} devices, one liar",
            "holding the fleet's top speed (`--attack-speed fastest`), 60 aggregations of 2",
            "updates, speeds lognormal over 10x, 0.1 s latency per job. Each cell: personalized /",
            "global accuracy over the 9 honest devices, and the simulated seconds the 60",
            "aggregations took (sync: the 12 rounds, in which every device trains once a round,",
            "so the liar holds exactly its fair share).",
            "",
            *markdown_table(header, rows),
            "",
            MARKER,
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run the table and write it into docs/results.md (or only print it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--print-only", action="store_true", help="do not write the doc")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    one_thread()
    logging.disable(logging.WARNING)
    cells: dict[tuple[str, str], list[Cell]] = {}
    for attack in ATTACKS:
        for column in COLUMNS:
            cells[attack, column] = [run_cell(attack, column, seed) for seed in seeds]
            print(f"{attack:10} {column}: {cells[attack, column][-1]}", flush=True)
    section = render_section(cells, seeds)
    print(section)
    if not args.print_only:
        write_section(args.doc, section, MARKER)


if __name__ == "__main__":
    main()
