"""`pfl-agent`: the device agent's command line (thin: it parses, calls the library, reports)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final

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
from protocols.extras import run_program
from protocols.program_options import exit_with_error
from protocols.settings_options import settings_options

app = typer.Typer(
    help="pfl-edge device agent: train personalized models on this device.", no_args_is_help=True
)
console = Console(stderr=True)

ConfigOption = Annotated[
    Path | None, typer.Option(help="TOML file with any setting (flags and PFL_* win)")
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")]
EXPORT_FLAGS: Final = (
    *("state_dir", "device_id", "broker", "fleet", "task", "model", "data_shard", "num_shards"),
    *("partition", "alpha", "labels_per_device", "groups", "fraction", "seed", "data"),
    "stateless",
)
"""The settings `export` rebuilds the model from: what `start` was given."""
DATA_HINT: Final = " (the digits task's built-in shards need scikit-learn; --data DIR needs none)"
"""Where a lean agent meets scikit-learn: the digits task's bundled data."""


@app.command()
@settings_options(AgentSettings)
def start(
    flags: dict[str, Any], config: ConfigOption = None, verbose: VerboseOption = False
) -> None:
    """Join a fleet and train in its rounds until SIGTERM or Ctrl-C.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    _serve(lambda: run_agent(AgentSettings.load(config, **flags)), verbose)


@app.command()
@settings_options(PoolSettings)
def pool(
    flags: dict[str, Any], config: ConfigOption = None, verbose: VerboseOption = False
) -> None:
    """Run virtual devices of a simulated fleet as real MQTT clients until SIGTERM or Ctrl-C.

    Pools on several machines with disjoint --devices ranges and one `pfl-coord serve
    --min-devices <num-shards>` make a simulation spread over machines: device i holds the data
    `pfl-coord simulate --devices <num-shards>` gives it. See docs/scaling.md.
    """
    _serve(lambda: run_pool(PoolSettings.load(config, **flags)), verbose)


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
@settings_options(
    AgentSettings,
    only=EXPORT_FLAGS,
    helps={
        "state_dir": "the agent's state directory (default: ./pfl-agent-state)",
        "device_id": "this device's id (default: the one the agent recorded)",
        "broker": "accepted as for start; unused",
        "stateless": "the agent kept no personal state",
    },
)
def export(
    out: Annotated[Path, typer.Option(help="where to write the ONNX file, e.g. model.onnx")],
    quantize: Annotated[
        str | None,
        typer.Option(
            help="int8 (dynamic) or int8-static (calibrated on this device's own data): also "
            "write <out>.int8.onnx beside it"
        ),
    ] = None,
    guard: Annotated[
        bool, typer.Option("--guard", help="ship the global model where it validates better")
    ] = False,
    *,
    flags: dict[str, Any],
    config: Annotated[
        Path | None, typer.Option(help="the TOML file `start` used (flags and PFL_* win)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    verbose: VerboseOption = False,
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
    values = dict(flags)
    try:
        if values["device_id"] is None:  # the id the agent ran as, from its state dir
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


def run() -> None:
    """The `pfl-agent` console script: the app, with a lean install's missing packages named."""
    run_program(__name__, DATA_HINT)


if __name__ == "__main__":
    run()
