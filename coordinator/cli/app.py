"""`pfl-coord`: the coordinator's command line (thin: it parses, calls the library, draws)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator.cli.fleet import dashboard as dashboard_command
from coordinator.cli.fleet import export, provision, status
from coordinator.cli.options import (
    AlgorithmOption,
    BatchSizeOption,
    BufferOption,
    CaOption,
    CertOption,
    CompressDownOption,
    CompressOption,
    ConcurrencyOption,
    ConfigOption,
    CountSpreadOption,
    DashboardCertOption,
    DashboardKeyOption,
    DashboardOption,
    DashboardTokenFileOption,
    DashboardTokenOption,
    DevicesOption,
    DpAdaptiveClipOption,
    DpClipOption,
    DpDeltaOption,
    DpDistributionOption,
    DpEpsilonOption,
    DpMechanismOption,
    DpNoiseOption,
    DpOnBudgetOption,
    DpPlacementOption,
    DpSamplingOption,
    EvalEveryOption,
    FairShareOption,
    FairShareWindowOption,
    FleetOption,
    InsecureOption,
    KeyOption,
    LocalEpochsOption,
    LrOption,
    MaxCountRatioOption,
    MaxSamplesOption,
    MaxStalenessOption,
    MaxWeightShareOption,
    ModeOption,
    NormBoundOption,
    OutOption,
    ParticipationOption,
    PasswordOption,
    PersonalOption,
    PresetOption,
    PretrainOption,
    QuarantineOption,
    RoundsOption,
    SecaggClipOption,
    SecaggNeighborsOption,
    SecaggOption,
    SecaggThresholdOption,
    SeedOption,
    StalenessOption,
    TaskOption,
    UserOption,
    VerboseOption,
    configure_logging,
    console,
)
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
from protocols.program_options import (
    AlphaOption,
    FractionOption,
    GroupsOption,
    LabelsOption,
    PartitionOption,
    exit_with_error,
)

app = typer.Typer(
    help="pfl-edge coordinator: run federated rounds for a fleet of devices.", no_args_is_help=True
)


@app.command()
def simulate(
    task: TaskOption = None,
    algorithm: AlgorithmOption = None,
    devices: DevicesOption = None,
    rounds: RoundsOption = None,
    seed: SeedOption = None,
    out: OutOption = None,
    participation: ParticipationOption = None,
    local_epochs: LocalEpochsOption = None,
    batch_size: BatchSizeOption = None,
    lr: LrOption = None,
    partition: PartitionOption = None,
    alpha: AlphaOption = None,
    labels_per_device: LabelsOption = None,
    groups: GroupsOption = None,
    fraction: FractionOption = None,
    personal: PersonalOption = None,
    eval_every: EvalEveryOption = None,
    max_count_ratio: MaxCountRatioOption = None,
    count_spread_power: CountSpreadOption = None,
    max_weight_share: MaxWeightShareOption = None,
    norm_bound: NormBoundOption = None,
    max_samples: MaxSamplesOption = None,
    quarantine_after: QuarantineOption = None,
    compress: CompressOption = None,
    compress_down: CompressDownOption = None,
    dp_noise: DpNoiseOption = None,
    dp_clip: DpClipOption = None,
    dp_placement: DpPlacementOption = None,
    dp_distribution: DpDistributionOption = None,
    dp_sampling: DpSamplingOption = None,
    dp_mechanism: DpMechanismOption = None,
    dp_delta: DpDeltaOption = None,
    dp_epsilon: DpEpsilonOption = None,
    dp_on_budget: DpOnBudgetOption = None,
    dp_adaptive_clip: DpAdaptiveClipOption = None,
    secagg: SecaggOption = None,
    secagg_neighbors: SecaggNeighborsOption = None,
    secagg_threshold: SecaggThresholdOption = None,
    secagg_clip: SecaggClipOption = None,
    mode: ModeOption = None,
    buffer: BufferOption = None,
    max_staleness: MaxStalenessOption = None,
    staleness: StalenessOption = None,
    concurrency: ConcurrencyOption = None,
    fair_share: FairShareOption = None,
    fair_share_window: FairShareWindowOption = None,
    transport: Annotated[
        str | None, typer.Option(help="inprocess or mqtt (default: inprocess)")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="processes running the virtual devices; results do not depend on it "
            "(default: one per available core)"
        ),
    ] = None,
    personal_preset: PresetOption = None,
    pretrain_rounds: PretrainOption = None,
    stateless: Annotated[
        bool | None,
        typer.Option("--stateless", help="devices rebuild personal parts every round"),
    ] = None,
    broker: Annotated[
        str | None, typer.Option(help="with --transport mqtt: mqtt:// URL (default: embedded)")
    ] = None,
    export_dir: Annotated[
        Path | None,
        typer.Option(help="after the final evaluation, export every device's ONNX model here"),
    ] = None,
    export_quantize: Annotated[
        str | None, typer.Option(help="with --export-dir, int8: also write <device>.int8.onnx")
    ] = None,
    export_guard: Annotated[
        bool | None,
        typer.Option(
            "--export-guard",
            help="with --export-dir: ship the global model where it validates better",
        ),
    ] = None,
    sim_speeds: Annotated[
        str | None,
        typer.Option(
            help="device speeds: equal, or lognormal:<ratio of the 95th to the 5th percentile> "
            "(default: equal)"
        ),
    ] = None,
    sim_availability: Annotated[
        str | None,
        typer.Option(
            help="when devices are online: always, diurnal[:on_fraction[:period_s]] or "
            "trace:<sessions.csv> (default: always)"
        ),
    ] = None,
    sim_uptime: Annotated[
        float | None,
        typer.Option(
            help="mean simulated seconds online between random dropouts (default: 0, none)"
        ),
    ] = None,
    sim_downtime: Annotated[
        float | None, typer.Option(help="simulated seconds offline after a dropout (default: 300)")
    ] = None,
    sim_seconds_per_sample: Annotated[
        float | None,
        typer.Option(help="simulated seconds per sample and epoch at speed 1 (default: 0.01)"),
    ] = None,
    sim_latency: Annotated[
        float | None,
        typer.Option(help="simulated seconds per job beyond training (default: 1)"),
    ] = None,
    sim_deadline: Annotated[
        float | None,
        typer.Option(help="sync: a round's deadline in simulated seconds, 0 = none (default: 0)"),
    ] = None,
    attack: Annotated[
        str | None,
        typer.Option(
            help="malicious devices' attack: sign-flip, scaling, alie, ipm, label-flip, "
            "free-rider (default: none)"
        ),
    ] = None,
    malicious_fraction: Annotated[
        float | None,
        typer.Option(help="with --attack: share of the virtual devices that lie (default: 0)"),
    ] = None,
    attack_strength: Annotated[
        float | None,
        typer.Option(help="scaling factor (100), ALIE z (the paper's z_max) or IPM epsilon (0.1)"),
    ] = None,
    attack_speed: Annotated[
        str | None,
        typer.Option(
            help="with --attack: seed (liars' speeds drawn like any device's) or fastest (the "
            "liars get the fleet's top --sim-speeds) (default: seed)"
        ),
    ] = None,
    config: ConfigOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run a whole federated training with virtual devices on this machine.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    configure_logging(verbose)
    try:
        settings = SimulationSettings.load(
            config,
            **{k: v for k, v in locals().items() if k not in ("config", "verbose")},
        )
        result = _run_with_progress(
            settings, lambda advance: run_simulation(settings, on_round=advance)
        )
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)
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
def serve(
    task: TaskOption = None,
    algorithm: AlgorithmOption = None,
    rounds: RoundsOption = None,
    seed: SeedOption = None,
    participation: ParticipationOption = None,
    local_epochs: LocalEpochsOption = None,
    batch_size: BatchSizeOption = None,
    lr: LrOption = None,
    personal: PersonalOption = None,
    personal_preset: PresetOption = None,
    pretrain_rounds: PretrainOption = None,
    eval_every: EvalEveryOption = None,
    max_count_ratio: MaxCountRatioOption = None,
    count_spread_power: CountSpreadOption = None,
    max_weight_share: MaxWeightShareOption = None,
    norm_bound: NormBoundOption = None,
    max_samples: MaxSamplesOption = None,
    quarantine_after: QuarantineOption = None,
    compress: CompressOption = None,
    compress_down: CompressDownOption = None,
    dp_noise: DpNoiseOption = None,
    dp_clip: DpClipOption = None,
    dp_placement: DpPlacementOption = None,
    dp_distribution: DpDistributionOption = None,
    dp_sampling: DpSamplingOption = None,
    dp_mechanism: DpMechanismOption = None,
    dp_delta: DpDeltaOption = None,
    dp_epsilon: DpEpsilonOption = None,
    dp_on_budget: DpOnBudgetOption = None,
    dp_adaptive_clip: DpAdaptiveClipOption = None,
    secagg: SecaggOption = None,
    secagg_neighbors: SecaggNeighborsOption = None,
    secagg_threshold: SecaggThresholdOption = None,
    secagg_clip: SecaggClipOption = None,
    mode: ModeOption = None,
    buffer: BufferOption = None,
    max_staleness: MaxStalenessOption = None,
    staleness: StalenessOption = None,
    concurrency: ConcurrencyOption = None,
    fair_share: FairShareOption = None,
    fair_share_window: FairShareWindowOption = None,
    fleet: FleetOption = None,
    out: OutOption = None,
    broker: Annotated[
        str | None, typer.Option(help="mqtt(s):// URL; without it an embedded broker starts")
    ] = None,
    port: Annotated[int | None, typer.Option(help="embedded broker port (default: 1883)")] = None,
    min_devices: Annotated[
        int | None, typer.Option(help="devices online before a round (default: 1)")
    ] = None,
    round_timeout: Annotated[
        float | None, typer.Option(help="seconds a round waits (default: 600)")
    ] = None,
    quorum: Annotated[
        float | None, typer.Option(help="fraction of selected devices needed (default: 0.5)")
    ] = None,
    join_timeout: Annotated[
        float | None, typer.Option(help="seconds to wait for --min-devices (default: 3600)")
    ] = None,
    checkpoint_dir: Annotated[
        Path | None, typer.Option(help="checkpoint directory (default: ./pfl-coord-state)")
    ] = None,
    resume: Annotated[
        bool | None, typer.Option("--resume", help="continue from the last checkpoint")
    ] = None,
    fresh: Annotated[
        bool | None,
        typer.Option("--fresh", help="start over, replacing an earlier run's checkpoint"),
    ] = None,
    username: UserOption = None,
    password: PasswordOption = None,
    ca_file: CaOption = None,
    cert_file: CertOption = None,
    key_file: KeyOption = None,
    tls_insecure: InsecureOption = None,
    dashboard: DashboardOption = None,
    dashboard_token: DashboardTokenOption = None,
    dashboard_token_file: DashboardTokenFileOption = None,
    dashboard_open_to_local_users: Annotated[
        bool | None,
        typer.Option(
            "--dashboard-open-to-local-users",
            help="no dashboard token (loopback only): every user of this machine reads the fleet",
        ),
    ] = None,
    dashboard_cert: DashboardCertOption = None,
    dashboard_key: DashboardKeyOption = None,
    config: ConfigOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Coordinate federated rounds with real devices over MQTT, checkpointing every round.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    configure_logging(verbose)
    try:
        settings = ServeSettings.load(
            config,
            **{k: v for k, v in locals().items() if k not in ("config", "verbose")},
        )
        result = _run_with_progress(
            settings,
            lambda advance: run_serve(
                settings, on_round=advance, notify=lambda text: console.print(text)
            ),
        )
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)
    except KeyboardInterrupt:  # Ctrl-C: where it stopped and how to go on, in one line
        console.print(interrupted_line(settings.checkpoint_dir, sys.argv[1:]), soft_wrap=True)
        raise typer.Exit(130) from None
    _print_summary(result)
    exit_if_all_skipped(console, result.records)


@app.command()
def compare(
    algorithms: Annotated[
        str, typer.Option(help=f"comma-separated, from: {', '.join(algorithm_names())}")
    ],
    out: Annotated[
        Path, typer.Option(help="directory for comparison.md/.csv and <algorithm>/seed-<s>/ runs")
    ],
    seeds: Annotated[str, typer.Option(help="a count N (seeds 0..N-1) or a list like 0,4,7")] = "3",
    task: TaskOption = None,
    devices: DevicesOption = None,
    rounds: RoundsOption = None,
    participation: ParticipationOption = None,
    local_epochs: LocalEpochsOption = None,
    batch_size: BatchSizeOption = None,
    lr: LrOption = None,
    partition: PartitionOption = None,
    alpha: AlphaOption = None,
    labels_per_device: LabelsOption = None,
    groups: GroupsOption = None,
    fraction: FractionOption = None,
    personal: PersonalOption = None,
    personal_preset: PresetOption = None,
    pretrain_rounds: PretrainOption = None,
    stateless: Annotated[
        bool | None,
        typer.Option("--stateless", help="devices rebuild personal parts every round"),
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option(help="evaluate every N rounds (default: max(1, total rounds // 10))"),
    ] = None,
    config: ConfigOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Simulate the same workload with several algorithms and seeds; tabulate mean and std.

    Each run keeps its own run directory (OUT/<algorithm>/seed-<s>/); `pfl-coord report OUT`
    plots them. Every other flag is as for simulate (and PFL_* variables and --config apply).
    """
    configure_logging(verbose)
    overrides = {
        k: v
        for k, v in locals().items()
        if k not in ("algorithms", "out", "seeds", "config", "verbose")
    }
    try:
        specs = plan_runs(parse_algorithms(algorithms), parse_seeds(seeds), out, config, overrides)
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


@app.callback()
def main() -> None:
    """pfl-edge coordinator."""


if __name__ == "__main__":
    app()
