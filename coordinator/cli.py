"""`pfl-coord`: the coordinator's command line (thin: it parses, calls the library, draws)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator.rounds import RoundRecord
from coordinator.settings import SimulationSettings
from coordinator.simulate import SimulationResult, run_simulation
from protocols.errors import PflError

app = typer.Typer(
    help="pfl-edge coordinator: run federated rounds for a fleet of devices.", no_args_is_help=True
)
console = Console(stderr=True)

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with any setting (flags and PFL_* variables win)"),
]


def configure_logging(verbose: bool) -> None:
    """Rich log lines on stderr; library modules only create loggers."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )


@app.command()
def simulate(
    task: Annotated[
        str | None,
        typer.Option(
            help="task: digits, synthetic, gaussian, sine or module:attribute [default: digits]"
        ),
    ] = None,
    algorithm: Annotated[
        str | None, typer.Option(help="local, fedavg, fedavg-ft, fedprox [default: fedavg]")
    ] = None,
    devices: Annotated[int | None, typer.Option(help="virtual devices [default: 20]")] = None,
    rounds: Annotated[int | None, typer.Option(help="training rounds [default: 10]")] = None,
    seed: Annotated[
        int | None, typer.Option(help="seed of data, init, sampling, training [default: 0]")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="run directory for metrics.jsonl and summary.json")
    ] = None,
    participation: Annotated[
        float | None, typer.Option(help="fraction of devices per round [default: 1.0]")
    ] = None,
    local_epochs: Annotated[
        int | None, typer.Option(help="local epochs per round [default: 1]")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="local minibatch size [default: 10]")
    ] = None,
    lr: Annotated[float | None, typer.Option(help="local learning rate [default: 0.1]")] = None,
    partition: Annotated[
        str | None, typer.Option(help="iid, dirichlet, shards, powerlaw [default: dirichlet]")
    ] = None,
    alpha: Annotated[
        float | None, typer.Option(help="Dirichlet concentration [default: 0.5]")
    ] = None,
    labels_per_device: Annotated[
        int | None, typer.Option(help="labels per device for shards/powerlaw [default: 2]")
    ] = None,
    personal: Annotated[
        list[str] | None,
        typer.Option(help="personal parameter pattern, repeatable [default: the algorithm's]"),
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="evaluate every N rounds, 0 = at the end [default: 0]")
    ] = None,
    transport: Annotated[
        str | None, typer.Option(help="inprocess or mqtt [default: inprocess]")
    ] = None,
    config: ConfigOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    """Run a whole federated training with virtual devices on this machine.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    configure_logging(verbose)
    try:
        settings = SimulationSettings.load(
            config,
            task=task,
            algorithm=algorithm,
            devices=devices,
            rounds=rounds,
            seed=seed,
            out=out,
            participation=participation,
            local_epochs=local_epochs,
            batch_size=batch_size,
            lr=lr,
            partition=partition,
            alpha=alpha,
            labels_per_device=labels_per_device,
            personal=personal,
            eval_every=eval_every,
            transport=transport,
        )
        result = _run_with_progress(settings)
    except (PflError, ValueError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    _print_summary(result)


def _run_with_progress(settings: SimulationSettings) -> SimulationResult:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(
            f"{settings.algorithm} on {settings.task}", total=settings.rounds, loss="-"
        )

        def advance(record: RoundRecord) -> None:
            progress.update(bar, advance=1, loss=f"{record.train_loss:.4f}")

        return run_simulation(settings, on_round=advance)


def _print_summary(result: SimulationResult) -> None:
    summary = result.summary
    metric = summary["metric_name"]
    table = Table(
        title=(
            f"{summary['algorithm']} on {summary['task']}: {summary['devices']} devices, "
            f"{summary['rounds']} rounds ({metric})"
        )
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in (summary["metrics"] or {}).items():
        table.add_row(key, "n/a" if value is None else f"{value:.4f}")
    table.add_row("bytes up", f"{summary['bytes_up']:,}")
    table.add_row("bytes down", f"{summary['bytes_down']:,}")
    table.add_row("wall seconds", f"{summary['wall_seconds']:.2f}")
    Console().print(table)
    if summary.get("rejected_messages"):
        console.print(
            f"[yellow]{summary['rejected_messages']} messages were rejected (see log)[/yellow]"
        )


@app.callback()
def main() -> None:
    """pfl-edge coordinator."""
