"""`pfl-coord`: the coordinator's command line (thin: it parses, calls the library, draws)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator.cli.aggregator import aggregator as aggregator_command
from coordinator.cli.fleet import dashboard as dashboard_command
from coordinator.cli.fleet import export, provision, status
from coordinator.cli.options import ConfigOption, VerboseOption, configure_logging, console
from coordinator.engine.rounds import RoundRecord
from coordinator.ops.earlier_run import interrupted_line
from coordinator.ops.report import build_report
from coordinator.ops.run_outcome import exit_if_all_skipped
from coordinator.run.compare import (
    COLUMNS,
    RunOutcome,
    RunSpec,
    format_cells,
    parse_algorithms,
    parse_seeds,
    plan_runs,
    run_comparison,
)
from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from protocols.algorithms import algorithm_names
from protocols.errors import PflError
from protocols.program_options import exit_with_error, wait_for_interrupt
from protocols.settings_options import settings_options

app = typer.Typer(
    help="pfl-edge coordinator: run federated rounds for a fleet of devices.", no_args_is_help=True
)


SIMULATE_TOML_ONLY: Final = ("fleet",)
"""Settings `simulate` takes from PFL_* variables and --config only."""
SERVE_TOML_ONLY: Final = ("host", "round_retries")
COMPARE_FLAGS: Final = (
    *("task", "model", "devices", "rounds", "participation", "local_epochs", "batch_size", "lr"),
    *("partition", "alpha", "labels_per_device", "groups", "fraction"),
    *("personal", "personal_preset", "pretrain_rounds", "stateless", "eval_every"),
)
"""The settings `compare` offers as flags (the workload; every run gets its own algorithm)."""

Settings = TypeVar("Settings", SimulationSettings, ServeSettings)


@app.command()
@settings_options(SimulationSettings, exclude=SIMULATE_TOML_ONLY)
def simulate(
    flags: dict[str, Any], config: ConfigOption = None, verbose: VerboseOption = False
) -> None:
    """Run a whole federated training with virtual devices on this machine.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    _run_shown(
        verbose,
        lambda: SimulationSettings.load(config, **flags),
        lambda settings, advance: run_simulation(settings, on_round=advance),
    )


def _run_shown(
    verbose: bool,
    load: Callable[[], Settings],
    run: Callable[[Settings, Callable[[RoundRecord], None]], SimulationResult | ServeResult],
    on_interrupt: Callable[[Settings], str] | None = None,
    summary_shown: Callable[[], bool] = lambda: False,
) -> None:
    """Load the settings, run with a progress bar, then print the summary; errors exit.

    `on_interrupt`: the line Ctrl-C prints (where the run stopped, how to go on), exit 130.
    """
    configure_logging(verbose)
    settings: Settings | None = None
    try:
        settings = load()
        result = _run_with_progress(settings, lambda advance: run(settings, advance))
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)
    except KeyboardInterrupt:
        if on_interrupt is None or settings is None:
            raise
        console.print(on_interrupt(settings), soft_wrap=True)
        raise typer.Exit(130) from None
    if not summary_shown():  # a run that lingered printed it before waiting
        _print_summary(result)
    exit_if_all_skipped(console, result.records)


def _run_with_progress(
    settings: SimulationSettings | ServeSettings,
    run: Callable[[Callable[[RoundRecord], None]], SimulationResult | ServeResult],
) -> SimulationResult | ServeResult:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(
            f"{settings.algorithm} on {settings.task}",
            total=settings.pretrain_rounds + settings.rounds,
            loss="-",
        )

        def advance(record: RoundRecord) -> None:
            loss = record.train_loss
            shown = f"{loss:.4f}" if math.isfinite(loss) else "not reported (DP)"
            progress.update(bar, completed=record.round_id, loss=shown)

        return run(advance)


def _print_summary(result: SimulationResult | ServeResult) -> None:
    summary = result.summary
    table = Table(
        title=(
            f"{summary.algorithm} on {summary.task}: {summary.devices} devices, "
            f"{summary.rounds} rounds ({summary.metric_name})"
        )
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in (summary.metrics or {}).items():
        table.add_row(key, "n/a" if value is None else f"{value:.4f}")
    if summary.privacy is not None:
        table.add_row(
            f"DP epsilon (delta {summary.privacy['delta']:g})", f"{summary.privacy['epsilon']:.3f}"
        )
        table.add_row(  # against the fleet and the broker, who read every announced cohort
            "DP epsilon vs fleet", f"{summary.privacy['epsilon_vs_fleet']:.3f}"
        )
    table.add_row("bytes up", f"{summary.bytes_up:,}")
    table.add_row("bytes down", f"{summary.bytes_down:,}")
    table.add_row("wall seconds", f"{summary.wall_seconds:.2f}")
    if summary.sim_seconds is not None:
        table.add_row("simulated seconds", f"{summary.sim_seconds:.1f}")
    if summary.export:
        exported = summary.export
        table.add_row(
            "exported",
            f"{exported['ok']} ok, {exported['failed']} failed, {exported['total_bytes']:,} bytes",
        )
    Console().print(table)
    if summary.rejected_messages:
        console.print(
            f"[yellow]{summary.rejected_messages} messages were rejected (see log)[/yellow]"
        )


@app.command()
@settings_options(ServeSettings, exclude=SERVE_TOML_ONLY)
def serve(
    flags: dict[str, Any], config: ConfigOption = None, verbose: VerboseOption = False
) -> None:
    """Coordinate federated rounds with real devices over MQTT, checkpointing every round.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    shown: list[ServeResult] = []

    def linger(result: ServeResult) -> None:  # with --dashboard: the page outlives the run
        _print_summary(result)
        shown.append(result)
        if not sys.stdin.isatty():  # a script's serve ends with its run
            return
        console.print("the run is over; the dashboard stays up until you press Ctrl-C")
        wait_for_interrupt()

    _run_shown(
        verbose,
        lambda: ServeSettings.load(config, **flags),
        lambda settings, advance: run_serve(
            settings, advance, lambda text: console.print(text), linger=linger
        ),
        on_interrupt=lambda settings: interrupted_line(settings.checkpoint_dir, sys.argv[1:]),
        summary_shown=lambda: bool(shown),
    )


@app.command()
@settings_options(
    SimulationSettings,
    only=COMPARE_FLAGS,
    helps={"eval_every": "evaluate every N rounds (default: max(1, total rounds // 10))"},
)
def compare(
    algorithms: Annotated[
        str, typer.Option(help=f"comma-separated, from: {', '.join(algorithm_names())}")
    ],
    out: Annotated[
        Path, typer.Option(help="directory for comparison.md/.csv and <algorithm>/seed-<s>/ runs")
    ],
    seeds: Annotated[str, typer.Option(help="a count N (seeds 0..N-1) or a list like 0,4,7")] = "3",
    *,
    flags: dict[str, Any],
    config: ConfigOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Simulate the same workload with several algorithms and seeds; tabulate mean and std.

    Each run keeps its own run directory (OUT/<algorithm>/seed-<s>/); `pfl-coord report OUT`
    plots them. Every other flag is as for simulate (and PFL_* variables and --config apply).
    """
    configure_logging(verbose)
    try:
        specs = plan_runs(parse_algorithms(algorithms), parse_seeds(seeds), out, config, flags)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            runs_bar = progress.add_task("runs", total=len(specs), detail="")
            rounds_bar = progress.add_task("rounds", total=1, detail="")

            def started(spec: RunSpec) -> None:
                total = spec.settings.pretrain_rounds + spec.settings.rounds
                progress.update(runs_bar, detail=f"{spec.algorithm} seed {spec.seed}")
                progress.reset(rounds_bar, total=total, detail="")

            def finished(outcome: RunOutcome) -> None:
                progress.advance(runs_bar)

            def advance(record: RoundRecord) -> None:
                progress.update(
                    rounds_bar, completed=record.round_id, detail=f"loss {record.train_loss:.4f}"
                )

            result = run_comparison(
                specs, out, on_run_start=started, on_run_end=finished, on_round=advance
            )
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)
    table = Table(title=f"{len(result.runs)} runs, mean ± std over seeds ({out / 'comparison.md'})")
    table.add_column("algorithm")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for row in result.rows:
        table.add_row(row.algorithm, *format_cells(row))
    Console().print(table)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="--out directory of simulate, serve or compare")],
) -> None:
    """Plot accuracy per round, per-device histograms and gains into RUN_DIR/plots/ (PNG)."""
    configure_logging(False)
    try:
        result = build_report(run_dir)
    except (FileNotFoundError, ValueError) as error:
        exit_with_error(console, error)
    console.print(
        f"{result.runs} run(s) of {', '.join(result.algorithms)}: "
        f"{len(result.plots)} plot(s) in {result.out_dir}"
    )
    for path in result.plots:
        console.print(f"  {path}")
    for reason in result.skipped:
        console.print(f"  [yellow]skipped[/yellow] {reason}")


for command in (status, export, provision):
    app.command()(command)
app.command(name="dashboard")(dashboard_command)
app.command(name="aggregator")(aggregator_command)


@app.callback()
def main() -> None:
    """pfl-edge coordinator."""


if __name__ == "__main__":
    app()
