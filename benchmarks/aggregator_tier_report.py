"""The aggregator tier benchmark's table, its per-device and per-aggregator costs, and its plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.aggregator_tier"


@dataclass(frozen=True)
class Run:
    """One configuration and its medians (`benchmarks.aggregator_tier.measure`)."""

    devices: int
    participation: float
    groups: int
    result: dict[str, float]

    def __getitem__(self, key: str) -> float:
        return self.result[key]


def save(runs: Sequence[Run], path: Path) -> None:
    """The raw runs as JSON (`load` reads them back to redraw the table and plot)."""
    path.write_text(json.dumps([asdict(r) for r in runs], indent=1))


def load(path: Path) -> list[Run]:
    """Runs `save` wrote."""
    return [Run(**entry) for entry in json.loads(path.read_text())]


def size(value: float) -> str:
    """Bytes with a binary unit."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


HEADER = (
    "devices",
    "participation",
    "updates/round",
    "aggregators",
    "coordinator CPU/round",
    "of which fleet status",
    "fleet status sent/round",
    "coordinator inbound/round",
    "held at aggregation",
    "RSS registered",
    "peak RSS",
    "busiest aggregator CPU/round",
    "aggregator CPU/update",
)


def row(run: Run) -> list[str]:
    """One table row."""
    updates, groups = run["updates"], run.groups
    per_update = run["aggregators_s"] / updates * 1e3 if groups and updates else None
    return [
        f"{run.devices:,}",
        f"{run.participation:g}",
        f"{updates:,.0f}",
        str(groups) if groups else "none",
        f"{run['coordinator_s'] * 1e3:,.0f} ms",
        f"{run['status_s'] * 1e3:,.0f} ms",
        f"{size(run['status_bytes'])} in {run.result.get('status_messages', 1):,.0f}",
        size(run["inbound"]),
        size(run["held"]),
        size(run["rss_registered"]),
        size(run["rss_peak"]),
        f"{run['aggregator_s'] * 1e3:,.0f} ms" if groups else "-",
        f"{per_update:.2f} ms" if per_update is not None else "-",
    ]


def sizing(runs: Sequence[Run]) -> list[str]:
    """Per-device and per-aggregator costs from the largest fleet's rows (what a reader scales)."""
    largest = max(r.devices for r in runs)
    big = [r for r in runs if r.devices == largest]
    busiest = max(r.participation for r in big)
    full = [r for r in big if r.participation == busiest]
    flat = [r for r in full if not r.groups]
    tiered = [r for r in full if r.groups]
    registry = max((r["rss_registered"] - r["rss_built"]) / r.devices for r in big)
    sent = [(r, r.result.get("status_messages", 1.0)) for r in big]
    per_row_s = statistics.median(r["status_s"] / n for r, n in sent)
    per_row = max(r["status_bytes"] / n for r, n in sent)
    lines = [
        f"Per-device and per-aggregator costs, from the {largest:,}-device rows:",
        "",
        f"- every registered device: {registry:,.0f} B of coordinator memory (RSS after the "
        "hellos minus before); the fleet status costs a round nothing for a device whose row did "
        f"not change: each round sends the rows that changed (here the round's updates) at "
        f"{per_row:,.0f} B and {per_row_s * 1e6:.0f} us of coordinator CPU each (median), and a "
        "summary of fixed size; the first round after the devices joined sends every row once, "
        f"and the broker then retains one row per device ({size(per_row * largest)} at "
        f"{largest:,} devices: in this benchmark the in-process hub, whose memory counts in the "
        "process's peak RSS, with the coordinator's 8-byte digest per row);",
    ]

    def besides_status(run: Run) -> float:
        return (run["coordinator_s"] - run["status_s"]) / run["updates"]

    if flat:
        inbound = statistics.median(r["inbound"] / r["updates"] for r in flat)
        lines.append(
            f"- without the tier, at participation {busiest:g}, every update: "
            f"{statistics.median(map(besides_status, flat)) * 1e3:.2f} ms of coordinator CPU "
            f"besides the fleet status, and {inbound:,.0f} B inbound;"
        )
    if tiered:
        partial = max(r["inbound"] / r.groups for r in tiered)
        aggregator = statistics.median(r["aggregators_s"] / r["updates"] for r in tiered)
        ids = statistics.median((r["inbound"] - r["held"]) / r["updates"] for r in tiered)
        lines.append(
            f"- with the tier, at participation {busiest:g}, every update: {aggregator * 1e3:.2f} "
            f"ms of aggregator CPU, {statistics.median(map(besides_status, tiered)) * 1e3:.2f} ms "
            f"of coordinator CPU besides the fleet status, and {ids:.0f} B inbound at the "
            "coordinator (its device id in a partial's header); every aggregator: one partial a "
            f"round, at most {size(partial)} inbound at the coordinator;"
        )
    sparse = sorted((r for r in big if r.participation < busiest), key=lambda r: r.groups)
    if sparse:
        spent = ", ".join(
            f"{(r['coordinator_s'] - r['status_s']) * 1e3:,.0f} ms "
            + (f"with {r.groups} aggregators" if r.groups else "without the tier")
            for r in sparse
        )
        lines.append(
            f"- at participation {sparse[0].participation:g} ({sparse[0]['updates']:,.0f} "
            f"updates), the coordinator's CPU a round besides the fleet status: {spent}."
        )
    same = _same_cohort(runs)
    if same:
        lines.append(
            "- the same cohort in a larger fleet (the coordinator's CPU, of which fleet status, "
            "inbound and peak RSS minus RSS registered, a round): "
            + "; ".join(
                f"{r.devices:,} devices at {r.participation:g}"
                + (f" with {r.groups} aggregators" if r.groups else " without the tier")
                + f": {r['coordinator_s'] * 1e3:,.0f} ms, {r['status_s'] * 1e3:,.0f} ms, "
                f"{size(r['inbound'])}, {size(r['rss_peak'] - r['rss_registered'])}"
                for r in same
            )
            + "."
        )
    return lines


def _same_cohort(runs: Sequence[Run]) -> list[Run]:
    """Runs with as many updates a round as the sparse largest fleet's, by tier and devices."""
    largest = max(r.devices for r in runs)
    sparse = [r for r in runs if r.devices == largest and r.participation < 1.0]
    if not sparse:
        return []
    cohort = min(r["updates"] for r in sparse)
    tiers = {r.groups for r in sparse if r["updates"] == cohort}
    same = [r for r in runs if r["updates"] == cohort and r.groups in tiers]
    return sorted(same, key=lambda r: (r.groups, r.devices))


def plot(runs: Sequence[Run], path: Path) -> None:
    """Coordinator CPU, inbound bytes and memory a round against devices, one line a tier.

    Top: at the highest participation (the cohort grows with the fleet). Bottom: one cohort
    size in fleets of different sizes (`_same_cohort`): what the fleet alone adds.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    participation = max(r.participation for r in runs)
    shown = [r for r in runs if r.participation == participation]
    same = _same_cohort(runs)
    rows = [(f"participation {participation:g}", shown)]
    if same:
        rows.append((f"{same[0]['updates']:,.0f} updates a round", same))
    figure = Figure(figsize=(10, 3.0 * len(rows)), dpi=80, layout="constrained")
    FigureCanvasAgg(figure)
    panels: tuple[tuple[str, Callable[[Run], float]], ...] = (
        ("coordinator CPU / round (s)", lambda r: r["coordinator_s"]),
        ("coordinator inbound / round (MiB)", lambda r: r["inbound"] / 2**20),
        (
            "peak RSS - RSS registered (MiB)",
            lambda r: (r["rss_peak"] - r["rss_registered"]) / 2**20,
        ),
    )
    for row_index, (title, chosen) in enumerate(rows):
        for index, (label, value) in enumerate(panels):
            axes = figure.add_subplot(len(rows), len(panels), row_index * len(panels) + index + 1)
            for groups in sorted({r.groups for r in chosen}):
                line = sorted((r for r in chosen if r.groups == groups), key=lambda r: r.devices)
                axes.plot(
                    [r.devices for r in line],
                    [value(r) for r in line],
                    marker="o",
                    label=f"{groups} aggregators" if groups else "no tier",
                )
            axes.set_xscale("log")
            axes.set_yscale("log")
            axes.set_xlabel("devices")
            axes.set_title(label, fontsize="small")
            if index == 0:
                axes.set_ylabel(title)
            axes.grid(alpha=0.3)
            if index == 0:
                axes.legend(fontsize="small")
    figure.suptitle("FedAvg, synthetic model", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def section(runs: Sequence[Run], rounds: int, params: int, plot_path: Path | None) -> list[str]:
    """The docs/benchmarks.md section."""
    from benchmarks.common import markdown_table

    lines = [
        "## The aggregator tier: the coordinator's cost per round",
        "",
        "Without the tier the coordinator decodes and holds every update; with it, one partial "
        "aggregate per aggregator (docs/scaling.md). CPU is thread time, the coordinator's "
        "without the re-checks of its waits (the in-process hub re-checks after every delivery, "
        "to anyone); the machine is shared, so timings vary by up to 2x between runs; bytes are "
        "exact. RSS is the whole benchmark process's (coordinator, aggregators, and a stand-in "
        "fleet that holds only device ids), each configuration in a fresh process: what the "
        "registration adds is the coordinator's registry, and the peak adds the round's "
        "updates (held by the coordinator without the tier, by the aggregators with it, in "
        "float64).",
        "",
        *markdown_table(HEADER, [row(r) for r in runs]),
        "",
        *sizing(runs),
        "",
        f"FedAvg on the synthetic task's model ({params:,} float32 parameters), median of "
        f"{rounds} rounds, one thread: `{COMMAND} --out docs/benchmarks.md --plot "
        "docs/aggregator_tier.png` (about 6 minutes on a shared 2-core machine). The devices "
        "are a stand-in that sends each selected device's update frame (no training); the "
        "coordinator and aggregators are the real ones on the in-process hub.",
    ]
    if plot_path is not None:
        lines += ["", f"![The coordinator's cost against devices]({plot_path.name})"]
    return lines
