"""`pfl-agent`: the device agent's command line (thin: it parses, calls the library, reports)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from device_agent.offline_export import export_offline, recorded_device_id
from device_agent.pool import run_pool
from device_agent.runner import run_agent
from device_agent.settings import AgentSettings, PoolSettings
from device_agent.shard_check import unsplit_shard_problem
from device_agent.state_store import DiskStateStore
from pfl_tasks.base import PartitionSpec
from pfl_tasks.datadir import load_npy, read_csv_columns, save_device_data, split_arrays
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
    help="pfl-edge device agent: train personalized models on this device.", no_args_is_help=True
)
console = Console(stderr=True)

BrokerOption = Annotated[
    str | None, typer.Option(help="mqtt(s):// URL (default: mqtt://127.0.0.1:1883)")
]
FleetOption = Annotated[str | None, typer.Option(help="fleet name (default: default)")]
TaskOption = Annotated[str | None, typer.Option(help="task name or module:attribute")]
SeedOption = Annotated[int | None, typer.Option(help="the run's seed (default: 0)")]
StatelessOption = Annotated[bool | None, typer.Option("--stateless", help="keep no personal state")]
UsernameOption = Annotated[str | None, typer.Option(help="broker user name")]
PasswordOption = Annotated[str | None, typer.Option(help="broker password (or PFL_PASSWORD)")]
CaFileOption = Annotated[str | None, typer.Option(help="CA file for mqtts:// brokers")]
CertFileOption = Annotated[str | None, typer.Option(help="client certificate")]
KeyFileOption = Annotated[str | None, typer.Option(help="client certificate's key")]
TlsInsecureOption = Annotated[
    bool | None, typer.Option("--tls-insecure", help="skip the host name check")
]
ConfigOption = Annotated[
    Path | None, typer.Option(help="TOML file with any setting (flags and PFL_* win)")
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        help="most torch threads training uses (default: the cores available; a model too "
        "small to gain from them trains on fewer)"
    ),
]


@app.command()
def start(
    broker: BrokerOption = None,
    device_id: Annotated[
        str | None,
        typer.Option(help="this device's id (default: <host name>-<machine id prefix>)"),
    ] = None,
    fleet: FleetOption = None,
    task: TaskOption = None,
    data_shard: Annotated[
        int | None, typer.Option(help="index of this device's shard of the task's data")
    ] = None,
    num_shards: Annotated[int | None, typer.Option(help="shards in all (default: 20)")] = None,
    partition: PartitionOption = None,
    alpha: AlphaOption = None,
    labels_per_device: LabelsOption = None,
    groups: GroupsOption = None,
    fraction: FractionOption = None,
    seed: SeedOption = None,
    data: Annotated[
        Path | None, typer.Option(help="directory with train/test/val.npz instead of a shard")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="personal state directory (default: ./pfl-agent-state)")
    ] = None,
    stateless: StatelessOption = None,
    min_free_memory: Annotated[
        str | None, typer.Option(help="skip a round when less memory is free (200MB, 10%)")
    ] = None,
    max_load_per_core: Annotated[
        float | None, typer.Option(help="skip a round when the load per core is higher")
    ] = None,
    require_mains_power: Annotated[
        bool | None, typer.Option("--require-mains-power", help="skip rounds while on battery")
    ] = None,
    memory_budget: Annotated[
        str | None,
        typer.Option(help="training memory cap: 512MB, 1.5GiB, 70% or 0.7 of available memory"),
    ] = None,
    max_epochs: Annotated[
        int | None, typer.Option(help="decline rounds asking for more epochs (default: 100)")
    ] = None,
    max_steps: Annotated[
        int | None,
        typer.Option(help="most optimizer steps in one round, else decline (default: 100000)"),
    ] = None,
    max_round_seconds: Annotated[
        float | None,
        typer.Option(help="most seconds of local work in one round, else decline (default: 3600)"),
    ] = None,
    max_takeovers: Annotated[
        int | None,
        typer.Option(
            help="exit after this many connections in a row lost to another client with this "
            "device id, 0 = never (default: 3)"
        ),
    ] = None,
    dp_strict_egress: Annotated[
        bool | None,
        typer.Option(
            "--dp-strict-egress",
            help="release nothing outside DP's guarantee: declare 1 sample, train only in DP "
            "rounds, decline evaluations, no metrics or reasons in reports",
        ),
    ] = None,
    threads: ThreadsOption = None,
    username: UsernameOption = None,
    password: PasswordOption = None,
    ca_file: CaFileOption = None,
    cert_file: CertFileOption = None,
    key_file: KeyFileOption = None,
    tls_insecure: TlsInsecureOption = None,
    config: ConfigOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Join a fleet and train in its rounds until SIGTERM or Ctrl-C.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    values = {k: v for k, v in locals().items() if k not in ("config", "verbose")}
    _serve(lambda: run_agent(AgentSettings.load(config, **values)), verbose)


@app.command()
def pool(
    devices: Annotated[
        str, typer.Option(help="this pool's virtual devices, e.g. 0-499 (first-last, inclusive)")
    ],
    num_shards: Annotated[
        int, typer.Option(help="devices in the whole simulated fleet, over all pools")
    ],
    broker: BrokerOption = None,
    fleet: FleetOption = None,
    task: TaskOption = None,
    partition: PartitionOption = None,
    alpha: AlphaOption = None,
    labels_per_device: LabelsOption = None,
    groups: GroupsOption = None,
    fraction: FractionOption = None,
    seed: SeedOption = None,
    stateless: StatelessOption = None,
    threads: ThreadsOption = None,
    username: UsernameOption = None,
    password: PasswordOption = None,
    ca_file: CaFileOption = None,
    cert_file: CertFileOption = None,
    key_file: KeyFileOption = None,
    tls_insecure: TlsInsecureOption = None,
    config: ConfigOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run virtual devices of a simulated fleet as real MQTT clients until SIGTERM or Ctrl-C.

    Pools on several machines with disjoint --devices ranges and one `pfl-coord serve
    --min-devices <num-shards>` make a simulation spread over machines: device i holds the data
    `pfl-coord simulate --devices <num-shards>` gives it. See docs/scaling.md.
    """
    values = {k: v for k, v in locals().items() if k not in ("config", "verbose")}
    _serve(lambda: run_pool(PoolSettings.load(config, **values)), verbose)


def _serve(run: Callable[[], None], verbose: bool) -> None:
    """Log as the agent does and turn a refusal into one error line and exit code 2."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    try:
        run()
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)


@app.command("reset-state")
def reset_state(
    state_dir: Annotated[Path, typer.Option(help="the agent's state directory")],
) -> None:
    """Delete this device's personal state (it starts from the task's initialization next round)."""
    DiskStateStore(state_dir).clear()
    console.print(f"personal state in {state_dir} cleared")


@app.command()
def export(
    out: Annotated[Path, typer.Option(help="where to write the ONNX file, e.g. model.onnx")],
    state_dir: Annotated[
        Path | None, typer.Option(help="the agent's state directory (default: ./pfl-agent-state)")
    ] = None,
    quantize: Annotated[
        str | None, typer.Option(help="int8: also write <out>.int8.onnx beside it")
    ] = None,
    guard: Annotated[
        bool, typer.Option("--guard", help="ship the global model where it validates better")
    ] = False,
    device_id: Annotated[
        str | None, typer.Option(help="this device's id (default: the one the agent recorded)")
    ] = None,
    broker: Annotated[str | None, typer.Option(help="accepted as for start; unused")] = None,
    fleet: FleetOption = None,
    task: TaskOption = None,
    data_shard: Annotated[int | None, typer.Option(help="this device's shard index")] = None,
    num_shards: Annotated[int | None, typer.Option(help="shards in all (default: 20)")] = None,
    partition: Annotated[
        str | None,
        typer.Option(help="iid, dirichlet, shards, powerlaw, groups (default: dirichlet)"),
    ] = None,
    alpha: Annotated[float | None, typer.Option(help="Dirichlet concentration")] = None,
    labels_per_device: Annotated[int | None, typer.Option(help="labels per device")] = None,
    groups: Annotated[int | None, typer.Option(help="label groups")] = None,
    fraction: Annotated[float | None, typer.Option(help="share of the pooled data used")] = None,
    seed: SeedOption = None,
    data: Annotated[
        Path | None, typer.Option(help="directory with train/test/val.npz instead of a shard")
    ] = None,
    stateless: Annotated[
        bool | None, typer.Option("--stateless", help="the agent kept no personal state")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="the TOML file `start` used (flags and PFL_* win)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    """Export the personalized model offline, from a stopped agent's state directory.

    Give the same task and data flags (or --config) as `pfl-agent start`: the model is rebuilt
    from them, the last shared model and round the agent kept, and its personal state.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    values = {k: v for k, v in locals().items() if k not in ("config", "verbose", "as_json")}
    for name in ("out", "quantize", "guard"):
        del values[name]
    try:
        if device_id is None:  # the id the agent ran as, from its state dir (flag, env or file)
            probe = AgentSettings.load(config, **{**values, "device_id": "unknown"})
            values["device_id"] = recorded_device_id(probe.state_dir)
        settings = AgentSettings.load(config, **values)
        if (problem := unsplit_shard_problem(settings)) is not None:
            raise ValueError(problem)
        report = export_offline(settings, out, quantize=quantize, guard=guard)
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    elif report.ok:
        metric = report.metrics.get("exported")
        console.print(
            f"wrote {report.path} ({report.size_bytes:,} bytes, sha256 {report.sha256[:12]}, "
            f"max abs diff {report.parity_max_abs_diff:.2g}, held-out "
            f"{'-' if metric is None else f'{metric:.4f}'}) from round {report.round_id}"
        )
    else:
        console.print(f"[red]export failed:[/red] {report.error}")
    if not report.ok:
        raise typer.Exit(1)


@app.command("prepare-data")
def prepare_data(
    out: Annotated[Path, typer.Option(help="the device's --data directory to write")],
    csv_file: Annotated[
        Path | None, typer.Option("--csv", help="a CSV with a header row, numbers only")
    ] = None,
    target: Annotated[
        str | None, typer.Option(help="--csv: the column holding the targets")
    ] = None,
    inputs: Annotated[
        Path | None, typer.Option(help="a .npy of inputs, one row per sample (with --targets)")
    ] = None,
    targets: Annotated[Path | None, typer.Option(help="a .npy of targets (with --inputs)")] = None,
    val_fraction: Annotated[float, typer.Option(help="share kept for validation")] = 0.1,
    test_fraction: Annotated[float, typer.Option(help="share kept for testing")] = 0.25,
    seed: Annotated[int, typer.Option(help="seed of the shuffle")] = 0,
) -> None:
    """Write a device's --data directory (train/val/test.npz) from a CSV or from .npy arrays.

    CSV targets whose every value is a whole number become class labels; other columns are the
    inputs. Run `pfl-agent start --data OUT --task ...` on the device afterwards.
    """
    try:
        if (csv_file is None) == (inputs is None or targets is None):
            msg = "give --csv FILE --target COLUMN, or --inputs X.npy --targets Y.npy"
            raise ValueError(msg)
        if csv_file is not None:
            if target is None:
                msg = "--csv needs --target, the column holding the targets"
                raise ValueError(msg)
            features, values = read_csv_columns(csv_file, target)
        else:
            features, values = load_npy(inputs), load_npy(targets)  # type: ignore[arg-type]
        spec = PartitionSpec(val_fraction=val_fraction, test_fraction=test_fraction)
        data = split_arrays(features, values, spec, seed)
        save_device_data(data, out)
    except (ValueError, OSError) as error:
        exit_with_error(console, error)
    console.print(
        f"wrote {out}: {len(data.train)} train, {len(data.val)} validation, {len(data.test)} "
        f"test samples; inputs {tuple(data.train.inputs.shape[1:])} "
        f"{data.train.inputs.dtype}, targets {tuple(data.train.targets.shape[1:])} "
        f"{data.train.targets.dtype}"
    )


@app.callback()
def main() -> None:
    """pfl-edge device agent."""


if __name__ == "__main__":
    app()
