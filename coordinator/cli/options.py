"""What the `pfl-coord` commands share: options declared once with help and defaults, logging."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from protocols.algorithms import algorithm_names

TaskOption = Annotated[
    str | None,
    typer.Option(help="digits, synthetic, gaussian, sine or module:attribute (default: digits)"),
]
AlgorithmOption = Annotated[
    str | None, typer.Option(help=f"{', '.join(algorithm_names())} (default: fedavg)")
]
RoundsOption = Annotated[int | None, typer.Option(help="training rounds (default: 10)")]
SeedOption = Annotated[
    int | None, typer.Option(help="seed of data, init, sampling, training (default: 0)")
]
OutOption = Annotated[
    Path | None, typer.Option(help="run directory for metrics.jsonl and summary.json")
]
ParticipationOption = Annotated[
    float | None, typer.Option(help="fraction of devices per round (default: 1.0)")
]
LocalEpochsOption = Annotated[
    int | None, typer.Option(help="local epochs per round (default: the algorithm's, 1)")
]
BatchSizeOption = Annotated[
    int | None, typer.Option(help="local minibatch size (default: the algorithm's, 10)")
]
LrOption = Annotated[
    float | None, typer.Option(help="local learning rate (default: the algorithm's, 0.1)")
]
PersonalOption = Annotated[
    list[str] | None,
    typer.Option(help="personal parameter pattern, repeatable (default: the algorithm's)"),
]
PresetOption = Annotated[
    str | None,
    typer.Option(help="personal part by preset: output, input, split-input, adapters, all, none"),
]
PretrainOption = Annotated[
    int | None,
    typer.Option(help="FedAvg rounds first; personal parts then warm-start from them (default: 0)"),
]
EvalEveryOption = Annotated[
    int | None, typer.Option(help="evaluate every N rounds, 0 = at the end (default: 0)")
]
MaxCountRatioOption = Annotated[
    float | None,
    typer.Option(
        help="count no device above this x the round's lower median count, 0 = off (default: 3)"
    ),
]
CountSpreadOption = Annotated[
    float | None,
    typer.Option(help="where counts spread out, that multiple widens to (Q3/Q1)^this (default: 4)"),
]
MaxWeightShareOption = Annotated[
    float | None,
    typer.Option(help="no device weighs more than this share of a round, 1 = off (default: 0.5)"),
]
NormBoundOption = Annotated[
    float | None,
    typer.Option(help="clip updates to this x the round's median norm, 0 = off (default: 4)"),
]
MaxSamplesOption = Annotated[
    int | None,
    typer.Option(help="most training samples a device may declare (default: 100000000)"),
]
QuarantineOption = Annotated[
    int | None,
    typer.Option(
        help="messages of a device dropped in a round before it sits out the rest, 0 = off "
        "(default: 64)"
    ),
]
CompressOption = Annotated[
    str | None,
    typer.Option(
        help="how devices send updates: none, int8, int8:stochastic or topk:<fraction> such as "
        "topk:0.01, with error feedback (default: none)"
    ),
]
DpNoiseOption = Annotated[
    float | None,
    typer.Option(
        help="differential privacy: noise multiplier z; each shared delta is clipped and "
        "N(0, (z*clip)^2) is added to their sum (default: no DP)"
    ),
]
DpClipOption = Annotated[
    float | None, typer.Option(help="DP: L2 clip norm of each shared delta (default: 1.0)")
]
DpPlacementOption = Annotated[
    str | None,
    typer.Option(
        help="DP: who adds the noise, coordinator or device (device needs --secagg; default: "
        "coordinator)"
    ),
]
DpDistributionOption = Annotated[
    str | None,
    typer.Option(
        help="DP: gaussian, or discrete-gaussian added by devices inside secure aggregation's "
        "integer ring (needs --dp-placement device; default: gaussian)"
    ),
]
DpSamplingOption = Annotated[
    str | None,
    typer.Option(
        help="DP: poisson (each device joins with probability --participation) or fixed "
        "(default: poisson; ftrl-tree takes the cohort as the strategy selects it)"
    ),
]
DpMechanismOption = Annotated[
    str | None,
    typer.Option(
        help="DP: dp-fedavg (fresh noise on each round's sum, amplified by --dp-sampling) or "
        "ftrl-tree (DP-FTRL's tree aggregation, no sampling needed; [dp_options] tree_restart, "
        "tree_participations) (default: dp-fedavg)"
    ),
]
DpDeltaOption = Annotated[float | None, typer.Option(help="DP: delta (default: 1e-5)")]
DpEpsilonOption = Annotated[
    float | None, typer.Option(help="DP: epsilon budget; the run stops before passing it")
]
DpOnBudgetOption = Annotated[
    str | None, typer.Option(help="DP: stop or warn at the budget (default: stop)")
]
DpAdaptiveClipOption = Annotated[
    bool | None,
    typer.Option("--dp-adaptive-clip", help="DP: move the clip norm to the median update norm"),
]
SecaggOption = Annotated[
    bool | None,
    typer.Option(
        "--secagg",
        help="secure aggregation: devices mask their updates so the coordinator learns only "
        "their sum",
    ),
]
SecaggNeighborsOption = Annotated[
    int | None,
    typer.Option(
        help="secagg: devices each masks with (0: every other selected device; k: SecAgg+ "
        "with k, for large cohorts) (default: 0)"
    ),
]
SecaggThresholdOption = Annotated[
    float | None,
    typer.Option(help="secagg: share of a device's neighbours needed to unmask (default: 0.6)"),
]
SecaggClipOption = Annotated[
    float | None,
    typer.Option(help="secagg: L2 clip norm of each shared delta without DP (default: 10)"),
]
CompressDownOption = Annotated[
    str | None,
    typer.Option(
        help="none, or int8: a device holding the previous model downloads an int8 delta "
        "(default: none)"
    ),
]
ModeOption = Annotated[
    str | None,
    typer.Option(help="sync (rounds) or async (buffered asynchronous aggregation) (default: sync)"),
]
BufferOption = Annotated[
    int | None, typer.Option(help="async: updates per aggregation, FedBuff's K (default: 10)")
]
MaxStalenessOption = Annotated[
    int | None,
    typer.Option(help="async: drop updates more aggregations behind than this (default: 10)"),
]
StalenessOption = Annotated[
    str | None,
    typer.Option(
        help="async: staleness weight: constant, poly[:a], hinge[:a[:b]] (default: poly:0.5)"
    ),
]
ConcurrencyOption = Annotated[
    int | None,
    typer.Option(help="async: devices training at once, 0 = participation x fleet (default: 0)"),
]
FairShareOption = Annotated[
    float | None,
    typer.Option(
        help="async: a device above this x its fair share of the recent buffers is asked later, "
        "and above its fair share weighed down; 0 = off (default: 2)"
    ),
]
FairShareWindowOption = Annotated[
    int | None,
    typer.Option(help="async: aggregations the fair share is counted over (default: 20)"),
]
FleetOption = Annotated[str | None, typer.Option(help="fleet name (default: default)")]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with any setting (flags and PFL_* variables win)"),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")]
DevicesOption = Annotated[int | None, typer.Option(help="virtual devices (default: 20)")]
UserOption = Annotated[str | None, typer.Option(help="broker user name", envvar="PFL_USERNAME")]
PasswordOption = Annotated[str | None, typer.Option(help="broker password", envvar="PFL_PASSWORD")]
CaOption = Annotated[
    str | None, typer.Option(help="CA file for mqtts:// brokers", envvar="PFL_CA_FILE")
]
CertOption = Annotated[
    str | None, typer.Option(help="client certificate (with --key-file)", envvar="PFL_CERT_FILE")
]
KeyOption = Annotated[
    str | None, typer.Option(help="client certificate's private key", envvar="PFL_KEY_FILE")
]
InsecureOption = Annotated[
    bool | None, typer.Option("--tls-insecure", help="skip the broker host name check")
]

console = Console(stderr=True)


def configure_logging(verbose: bool) -> None:
    """Rich log lines on stderr; library modules only create loggers."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )


DashboardOption = Annotated[
    str | None,
    typer.Option(help="HOST:PORT to serve the live web dashboard on, e.g. 127.0.0.1:8080"),
]
DashboardTokenOption = Annotated[
    str | None,
    typer.Option(
        help="token browsers must present (default: made up for this run and printed)",
        envvar="PFL_DASHBOARD_TOKEN",
    ),
]
DashboardTokenFileOption = Annotated[
    Path | None, typer.Option(help="also write the dashboard's token to this file (mode 0600)")
]
DashboardCertOption = Annotated[
    Path | None, typer.Option(help="TLS certificate (PEM) for the dashboard, e.g. provisioned")
]
DashboardKeyOption = Annotated[
    Path | None, typer.Option(help="private key (PEM) of --dashboard-cert")
]
