"""Whole runs with lying devices: each attack at 10% and 25%, each aggregator, sync and async.

The malicious virtual devices run the agent's own code with an attack behind its seam
(device_agent/attacks.py); the coordinator, its guard and the strategies are the ones `simulate`
and `serve` run. Every cell is one simulated run of FedAvg-FT on digits with 20 devices; its
final accuracy is measured over the honest devices only (an attacker's own score is not the
fleet's), personalized (after fine-tuning) and global, and set against the clean run with the
same aggregator. The table goes into docs/results.md (its "Robustness" section).

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.robustness [--seed 0]
        [--attacks sign-flip,alie] [--modes sync] [--print-only]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.common import choose, markdown_table, one_thread, write_section
from coordinator.engine.metrics import summarize_evaluations
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import device_name, run_simulation
from device_agent.attacks import ATTACKS, AttackPlan

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- robustness -->"
DEVICES: Final = 20
FRACTIONS: Final = (0.1, 0.25)
MODES: Final[dict[str, dict[str, Any]]] = {
    "sync": {"mode": "sync", "rounds": 20},
    "async": {"mode": "async", "rounds": 40, "buffer": 5, "sim_speeds": "lognormal:10"},
}
"""Async: 40 aggregations of 5 updates (10 updates per device on average), devices whose speeds
span 10x between the fastest and the slowest 5%: a fast liar would land in many buffers. The
default fair share (`fair_share` 2, window 20) asks a device again only while it holds under
twice its share of the last 20 buffers' slots."""
AGGREGATORS: Final[dict[str, dict[str, Any]]] = {
    "mean (guard defaults)": {},
    "median": {"robust_aggregation": "median"},
    "trimmed mean (0.25)": {"robust_aggregation": "trimmed-mean", "trim_fraction": 0.25},
    "centered clipping": {"robust_aggregation": "centered-clipping"},
}

REFERENCE: Final = "mean (guard defaults)"
"""What every cell is set against: the clean run with today's defaults."""


@dataclass(frozen=True)
class Cell:
    """One run's final accuracy over its honest devices."""

    personalized: float
    global_model: float
    seconds: float


def run_cell(mode: str, aggregator: str, attack: str, fraction: float, seed: int) -> Cell:
    """One simulated run; `attack` "none" is the clean run."""
    settings = SimulationSettings.load(
        None,
        task="digits",
        algorithm="fedavg-ft",
        devices=DEVICES,
        workers=1,
        seed=seed,
        attack=attack,
        malicious_fraction=0.0 if attack == "none" else fraction,
        algorithm_options=AGGREGATORS[aggregator],
        **MODES[mode],
    )
    liars: frozenset[int] = frozenset()
    if attack != "none":
        liars = AttackPlan.draw(attack, fraction, DEVICES, seed, None).malicious  # type: ignore[arg-type]
    honest_ids = {device_name(i) for i in range(DEVICES) if i not in liars}
    started = time.perf_counter()
    result = run_simulation(settings)
    metrics = summarize_evaluations([r for r in result.reports if r.device_id in honest_ids])
    personalized, global_model = metrics["personalized_mean"], metrics["global"]
    return Cell(
        personalized=float("nan") if personalized is None else personalized,
        global_model=float("nan") if global_model is None else global_model,
        seconds=time.perf_counter() - started,
    )


def score(cell: Cell, clean: Cell) -> str:
    """Personalized / global accuracy, and in brackets each one's change from `clean`, in points."""
    personal = 100 * (cell.personalized - clean.personalized)
    shared = 100 * (cell.global_model - clean.global_model)
    return f"{cell.personalized:.3f} / {cell.global_model:.3f} ({personal:+.1f} / {shared:+.1f})"


def render_section(
    results: dict[tuple[str, str, str, float], Cell],
    attacks: Sequence[str],
    modes: Sequence[str],
    seed: int,
    command: str,
) -> str:
    """The Robustness section of docs/results.md: one table per mode."""
    seconds = sum(cell.seconds for cell in results.values())
    lines = [
        MARKER,
        "<!-- written by benchmarks/robustness.py; do not edit -->",
        "## Robustness: whole runs with lying devices",
        "",
        f"`{command}` ({len(results)} runs, {seconds / 60:.1f} minutes of simulation on one",
        f"core; seed {seed}). FedAvg-FT on digits, {DEVICES} virtual devices, the default",
        "guard (counts at most 3x the round's lower median count, more where honest counts",
        "spread; weight share 0.5; norms clipped to 4x the lower median) in every run; the",
        "attackers run the agent's own code with an attack behind its seam",
        "(`device_agent/attacks.py`,",
        "`pfl-coord simulate --attack NAME --malicious-fraction F`). Each cell: final accuracy",
        "over the honest devices, personalized / global, and in brackets their change from the",
        "clean run with the defaults (the mean), in points. Sync: 20 rounds of",
        "every device. Async: 40 aggregations of 5 updates, device speeds lognormal over 10x,",
        "the default fair share (`--fair-share 2`, window 20).",
        "Attacks: sign-flip sends -x; scaling 100x; ALIE mean - z std of the attackers' honest",
        "updates (z the paper's z_max); IPM -0.1 x their mean; label-flip trains on y -> 9 - y;",
        "free-rider sends zeros declaring 1,000,000 samples.",
        "",
    ]
    for mode in modes:
        lines += [f"**{mode}**", ""]
        header = ["attack", "liars", *AGGREGATORS]
        clean = results[mode, REFERENCE, "none", 0.0]
        rows = [
            [
                "none (clean)",
                "0",
                *(score(results[mode, a, "none", 0.0], clean) for a in AGGREGATORS),
            ]
        ]
        for attack in attacks:
            for fraction in FRACTIONS:
                cells = [score(results[mode, a, attack, fraction], clean) for a in AGGREGATORS]
                rows.append([attack, f"{fraction:.0%}", *cells])
        lines += [*markdown_table(header, rows), ""]
    lines.append(MARKER)
    return "\n".join(lines)


def run_all(
    attacks: Sequence[str], modes: Sequence[str], seed: int
) -> dict[tuple[str, str, str, float], Cell]:
    """Every cell of the table, clean runs first."""
    results: dict[tuple[str, str, str, float], Cell] = {}
    plan = [("none", 0.0)] + [(a, f) for a in attacks for f in FRACTIONS]
    for mode in modes:
        for attack, fraction in plan:
            for aggregator in AGGREGATORS:
                cell = run_cell(mode, aggregator, attack, fraction, seed)
                results[mode, aggregator, attack, fraction] = cell
                print(
                    f"{mode:5} {attack:10} {fraction:4.0%} {aggregator:22} "
                    f"personalized {cell.personalized:.3f} global {cell.global_model:.3f} "
                    f"({cell.seconds:.1f} s)",
                    flush=True,
                )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """Run the table and write it into docs/results.md (or only print it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", help=f"comma-separated, of {', '.join(ATTACKS)}")
    parser.add_argument("--modes", help="comma-separated, of sync, async")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--print-only", action="store_true", help="do not write the doc")
    args = parser.parse_args(argv)
    attacks = choose(args.attacks, ATTACKS, "attack")
    modes = choose(args.modes, tuple(MODES), "mode")
    one_thread()
    logging.disable(logging.WARNING)
    results = run_all(attacks, modes, args.seed)
    command = "python -m benchmarks.robustness" + ("" if args.seed == 0 else f" --seed {args.seed}")
    section = render_section(results, attacks, modes, args.seed, command)
    print(section)
    if not args.print_only:
        write_section(args.doc, section, MARKER)


if __name__ == "__main__":
    main()
