"""A device's secure aggregation cost: masking with the whole cohort, or within its tier group.

With the aggregator tier each aggregator runs the flat protocol with its group's members only
(`coordinator.tier.secure_group`): the device's side is the same code (`SecureClient`: keys,
dealing shares to its neighbours, opening its inbox, masking with each neighbour's pairwise
stream, revealing) over a roster of its group instead of the cohort. So a device in a group of
g costs what a device in a flat cohort of g costs, whatever the fleet, and that is what this
measures: flat simulated secure rounds (synthetic task, FedAvg, one local epoch, every device
selected) for a cohort of m and for a cohort of g = m / groups, side by side in one run.

Per device and round: the thread CPU time of its `SecureClient` calls (training is not
counted), and the bytes it sends and receives (the round's totals over the devices; the model
download included, which is the same either way).

    OMP_NUM_THREADS=1 python -m benchmarks.tier_secagg_cost [--cohort 500] [--groups 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from benchmarks.common import markdown_table, one_thread, publish_section
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.secure_aggregation import SecureClient

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- tier-secagg-cost -->"
TIMED: Final = ("join", "receive", "answer")
"""The `SecureClient` calls a device makes for a secure round (`answer` masks the update)."""


class _DeviceClock:
    """Thread CPU seconds in `SecureClient`'s calls, summed over every device."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> _DeviceClock:
        for name in TIMED:
            original = getattr(SecureClient, name)
            self._originals[name] = original
            setattr(SecureClient, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(SecureClient, name, original)

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started

        return timed


def measure(devices: int, rounds: int) -> dict[str, float]:
    """Per device and round: secure CPU, bytes up and down; the phases' CPU per round."""
    with tempfile.TemporaryDirectory() as out, _DeviceClock() as clock:
        settings = SimulationSettings.load(
            None, task="synthetic", devices=devices, rounds=rounds, local_epochs=1, out=out,
            secagg=True, workers=1, batched="off",
        )  # fmt: skip
        records = run_simulation(settings).records
    return {
        "device_s": clock.seconds / devices / len(records),
        "up": statistics.fmean(r.bytes_up for r in records) / devices,
        "down": statistics.fmean(r.bytes_down for r in records) / devices,
    }


def _size(value: float) -> str:
    return f"{value / 2**10:,.0f} KiB" if value >= 2**10 else f"{value:.0f} B"


def main(argv: list[str] | None = None) -> None:
    """Measure the flat cohort and one group; write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cohort", type=int, default=500)
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks.md")
    args = parser.parse_args(argv)
    one_thread()
    group = args.cohort // args.groups
    flat, grouped = measure(args.cohort, args.rounds), measure(group, args.rounds)
    rows = []
    for label, size, cost in (
        (f"flat: one secure round of {args.cohort:,}", args.cohort, flat),
        (f"tier: {args.groups} groups of {group:,}", group, grouped),
    ):
        rows.append(
            [
                label,
                f"{size - 1:,}",
                f"{cost['device_s'] * 1e3:,.1f} ms",
                f"{cost['device_s'] / flat['device_s']:.3f}x",
                _size(cost["up"]),
                _size(cost["down"]),
            ]
        )
        print(rows[-1], flush=True)
    header = [
        f"{args.cohort:,} devices selected",
        "pairwise masks per device",
        "device secure CPU / round",
        "vs flat",
        "device bytes up / round",
        "device bytes down / round",
    ]
    command = (
        "OMP_NUM_THREADS=1 python -m benchmarks.tier_secagg_cost "
        f"--cohort {args.cohort} --groups {args.groups} --rounds {args.rounds}"
    )
    lines = [
        "## Secure aggregation within tier groups: a device's cost",
        "",
        "With the aggregator tier, each aggregator runs secure aggregation with its group only "
        "(docs/scaling.md): a device's roster, shares and pairwise masks are its group's, so its "
        "cost follows the group size, not the cohort. A device in a group of g runs the same "
        "code as a device in a flat cohort of g, measured so here, side by side in one run.",
        "",
        *markdown_table(header, rows),
        "",
        "Synthetic task (2,282 parameters), FedAvg, every pair masking (no --secagg-neighbors), "
        f"every device selected, {args.rounds} rounds each; CPU is the devices' `SecureClient` "
        "calls' thread time (no training), per device and round; bytes are per device and round "
        f"and include the model download: `{command}`.",
    ]
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
