"""`pfl-coord status`, `dashboard`, `export`, `provision`: the commands for a running fleet."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from coordinator.cli.options import (
    DashboardCertOption,
    DashboardKeyOption,
    DashboardTokenFileOption,
    DashboardTokenOption,
    VerboseOption,
    configure_logging,
    console,
)
from coordinator.dashboard.settings import DashboardSettings
from coordinator.ops.broker_config import BrokerLimits
from coordinator.ops.export_command import FleetExport, request_exports
from coordinator.ops.provision import provision as provision_fleet
from coordinator.ops.site_brokers import parse_site
from coordinator.ops.status import collect_fleet_view
from protocols.access import DEFAULT_MAX_UPLOAD_BYTES
from protocols.errors import PflError
from protocols.id_list import listed
from protocols.messages import CoordinatorStatus, ExportArguments
from protocols.program_options import exit_with_error, wait_for_interrupt
from protocols.program_settings import BrokerAccess
from protocols.settings_errors import SettingsError, describe_settings_error
from protocols.settings_options import settings_options
from protocols.transport.settings import MIB

BrokerUrlOption = Annotated[
    str, typer.Option(help="mqtt(s):// URL of the fleet's broker", envvar="PFL_BROKER")
]
FleetNameOption = Annotated[str, typer.Option(help="fleet name", envvar="PFL_FLEET")]


@settings_options(BrokerAccess, environment=True)
def status(
    broker: BrokerUrlOption,
    fleet: FleetNameOption = "default",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    listen: Annotated[float, typer.Option(help="seconds to collect retained messages")] = 1.5,
    *,
    flags: dict[str, Any],
) -> None:
    """Show the retained status of the coordinator, every device and each tier aggregator."""
    configure_logging(False)
    try:
        access = _access(flags)
        view = collect_fleet_view(access.broker_settings(broker), fleet, listen)
    except (PflError, ValueError) as error:
        exit_with_error(console, error)
    if as_json:
        typer.echo(json.dumps(view.as_json(), indent=2, sort_keys=True, allow_nan=False))
        return
    coordinator = view.coordinator
    title = (
        "no coordinator status"
        if coordinator is None
        else (
            f"fleet {fleet}: coordinator {coordinator.state}, round {coordinator.round_id}"
            f"/{coordinator.rounds} ({coordinator.algorithm} on {coordinator.task})"
        )
    )
    table = Table(title=title)
    for column in ("device", "online", "last seen", "round", "last loss", "dropped", "detail"):
        table.add_column(column)
    for row in view.rows():
        seen = (
            datetime.fromtimestamp(row["last_seen"]).strftime("%H:%M:%S")
            if row["last_seen"]
            else "-"
        )
        loss = "-" if row["last_loss"] is None else f"{row['last_loss']:.4f}"
        table.add_row(
            row["device"],
            _online_cell(row["online"], row["flapping"]),
            seen,
            "-" if row["round"] is None else str(row["round"]),
            loss,
            _dropped_cell(row["dropped"], row["quarantined"]),
            row["detail"],
        )
    Console().print(table)
    if view.aggregators.statuses:
        Console().print(_aggregator_table(view.aggregators.rows()))
    if coordinator is not None and (coordinator.reason or coordinator.missing_count):
        Console().print(_run_state_line(coordinator), markup=False)
    if view.rows_left_out():
        Console().print(f"{view.rows_left_out()} more device(s) not shown")
    if stragglers := view.stragglers():
        Console().print(
            f"round {view.fleet.round_id if view.fleet else '?'}: {len(stragglers)} straggler(s) "
            f"missed the deadline while connected: {listed(stragglers)}",
            markup=False,
        )
    if view.refused:
        Console().print(
            f"[red]ignored {view.refused} message(s) their topic may not carry[/red] "
            "(another device's status, a coordinator message on a device topic, a time ahead)"
        )
    if view.fleet is not None and view.fleet.scalars:
        scalars = ", ".join(f"{k} = {v:.4g}" for k, v in sorted(view.fleet.scalars.items()))
        Console().print(f"round {view.fleet.round_id} fleet scalars: {scalars}")


def _aggregator_table(rows: list[dict[str, Any]]) -> Table:
    """The aggregator tier: each aggregator's group and its last round."""
    table = Table(title="aggregators")
    for column in ("aggregator", "group", "state", "last round", "devices", "partial sent"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["aggregator"],
            row["group"],
            row["state"],
            "-" if row["round"] is None else str(row["round"]),
            f"{row['devices']} of {row['asked']} asked",
            f"{'yes' if row['partial_sent'] else 'no'} ({row['partials_sent']} in all)",
        )
    return table


@settings_options(BrokerAccess, environment=True)
def export(
    broker: BrokerUrlOption,
    fleet: FleetNameOption = "default",
    out_dir: Annotated[
        Path | None,
        typer.Option(help="directory on each device for <device>.onnx (default: its state dir)"),
    ] = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            help="int8 (dynamic) or int8-static (calibrated on each device's own data): also "
            "write <device>.int8.onnx"
        ),
    ] = None,
    guard: Annotated[
        bool, typer.Option("--guard", help="ship the global model where it validates better")
    ] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the devices")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    *,
    flags: dict[str, Any],
    verbose: VerboseOption = False,
) -> None:
    """Ask every device to export its personalized model to ONNX; exit 1 if any failed."""
    configure_logging(verbose)
    try:
        access = _access(flags)
        request = ExportArguments.checked(
            out_dir="" if out_dir is None else str(out_dir), quantize=quantize, guard=guard
        )
        result = request_exports(access.broker_settings(broker), fleet, request, timeout_s=timeout)
    except (PflError, ValueError) as error:
        exit_with_error(console, error)
    if as_json:
        typer.echo(json.dumps(result.as_json(), indent=2, sort_keys=True, allow_nan=False))
    else:
        _print_exports(fleet, result)
    if not result.ok:
        raise typer.Exit(1)


def _print_exports(fleet: str, result: FleetExport) -> None:
    answered = sum(1 for row in result.rows() if row["answered"])
    table = Table(title=f"fleet {fleet}: {answered} export report(s)")
    for column in ("device", "ok", "file", "size", "sha256", "parity", "metric", "chosen"):
        table.add_column(column, justify="right" if column in ("size", "parity") else "left")
    failures = []
    for row in result.rows():
        if not row["ok"]:
            table.add_row(row["device"], "[red]no[/red]", *["-"] * 6)
            failures.append(f"[red]{row['device']}:[/red] {row['error']}")
            continue
        metric = row["metric"]
        table.add_row(
            row["device"],
            "yes",
            row["path"],
            f"{row['size_bytes']:,}",
            row["sha256"][:12],
            f"{row['parity_max_abs_diff']:.2g}",
            "-" if metric is None else f"{metric:.4f}",
            row["chosen"] or "-",
        )
    Console().print(table)
    for line in failures:
        console.print(line)


def provision(
    devices: Annotated[str, typer.Option(help="comma-separated device ids, e.g. dev-1,dev-2")],
    out: Annotated[Path, typer.Option(help="directory for the broker files and credentials")],
    fleet: Annotated[str, typer.Option(help="fleet name")] = "default",
    host: Annotated[str, typer.Option(help="the broker's host name or IP, as devices use it")] = (
        "localhost"
    ),
    tls_port: Annotated[int, typer.Option(help="TLS listener port")] = 8883,
    plain_port: Annotated[
        int | None, typer.Option(help="also a plain listener on 127.0.0.1 at this port")
    ] = None,
    broker_dir: Annotated[
        Path | None, typer.Option(help="where the files will live on the broker (default: --out)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an earlier deployment")] = False,
    max_upload_mb: Annotated[
        float, typer.Option(help="largest update a device may send (bounds its retained data)")
    ] = DEFAULT_MAX_UPLOAD_BYTES / MIB,
    site: Annotated[
        list[str] | None,
        typer.Option(
            help="an aggregator tier's site, repeatable: name[:tls_port[:plain_port]]=dev-1,dev-2 "
            "(with ports: its own broker, bridged to this one; docs/scaling.md)"
        ),
    ] = None,
) -> None:
    """Write per-device broker credentials, password file, ACL and TLS config (docs/security.md)."""
    configure_logging(False)
    try:
        sites = [parse_site(text) for text in site or ()]
        result = provision_fleet(
            [d.strip() for d in devices.split(",") if d.strip()],
            out,
            fleet=fleet,
            host=host,
            tls_port=tls_port,
            plain_port=plain_port,
            broker_dir=broker_dir,
            force=force,
            limits=BrokerLimits(max_upload_bytes=int(max_upload_mb * MIB)),
            sites=sites,
        )
    except (PflError, ValueError, OSError) as error:
        exit_with_error(console, error)
    console.print(
        f"provisioned {len(result.devices)} device(s) of fleet {result.fleet} in {result.directory}"
        f"\n  broker: mosquitto -c {result.files['mosquitto.conf']}  ({result.broker_url})"
        f"\n  agents: {result.directory / 'devices'}/<id>.env; all secrets: credentials.json"
        "\n  serve: coordinator.env; status: viewer.env; dashboard: dashboard.env;"
        " export: operator.env (one account each: they run side by side)"
        "\n  the certificates in tls/ are for tests only: see docs/security.md",
        soft_wrap=True,
    )
    for placed in result.sites.values():
        console.print(
            f"  site {placed.site.name}: {placed.broker_url}; pfl-coord aggregator --config "
            f"{placed.files['aggregator.toml']}",
            soft_wrap=True,
        )
    if result.chown_command is None:
        console.print("  the broker's files belong to the mosquitto user, as it requires")
    else:  # mosquitto refuses 0600 files it does not own once it drops to its user
        console.print(
            f"  before starting mosquitto: {escape(result.chown_command)}", soft_wrap=True
        )


def _run_state_line(status: CoordinatorStatus) -> str:
    """Why the coordinator waits, stalled or stopped, and whom it misses."""
    parts = [status.reason] if status.reason else []
    if status.missing_count:
        more = status.missing_count - len(status.missing)
        tail = f" and {more} more" if more else ""
        parts.append(f"missing: {', '.join(status.missing)}{tail}")
    if status.deadline is not None:
        parts.append(f"until {datetime.fromtimestamp(status.deadline).strftime('%H:%M:%S')}")
    return f"{status.state}: " + "; ".join(parts)


def _online_cell(online: bool, flapping: bool) -> str:
    """Online or not; an id that keeps rejoining is probably on two devices."""
    cell = "yes" if online else "[red]no[/red]"
    return f"{cell} [red]flapping: one id on two devices?[/red]" if flapping else cell


def _dropped_cell(dropped: int, quarantined: bool) -> str:
    """How many messages the coordinator dropped, and whether the device sits out the round."""
    cell = str(dropped) if dropped else "-"
    return f"{cell} [red]quarantined[/red]" if quarantined else cell


@settings_options(BrokerAccess, environment=True)
def dashboard(
    broker: Annotated[
        str | None,
        typer.Option(help="mqtt(s):// URL of a running fleet's broker", envvar="PFL_BROKER"),
    ] = None,
    run: Annotated[
        Path | None,
        typer.Option(help="a run directory (--out of simulate or serve), finished or running"),
    ] = None,
    fleet: FleetNameOption = "default",
    listen: Annotated[
        str, typer.Option(help="HOST:PORT to listen on (loopback unless told otherwise)")
    ] = "127.0.0.1:8080",
    token: DashboardTokenOption = None,
    token_file: DashboardTokenFileOption = None,
    open_to_local_users: Annotated[
        bool,
        typer.Option(
            "--open-to-local-users",
            help="no token (loopback only): every user of this machine reads the fleet",
        ),
    ] = False,
    dashboard_cert: DashboardCertOption = None,
    dashboard_key: DashboardKeyOption = None,
    *,
    flags: dict[str, Any],
    verbose: VerboseOption = False,
) -> None:
    """Serve a live, read-only web dashboard of a fleet (through its broker) or of a run directory.

    Runs until interrupted (Ctrl-C).
    """
    configure_logging(verbose)
    if (broker is None) == (run is None):
        exit_with_error(console, ValueError("give either --broker URL or --run DIRECTORY"))
    settings = DashboardSettings(
        listen=listen,
        token=token,
        token_file=token_file,
        open_to_local_users=open_to_local_users,
        cert_file=dashboard_cert,
        key_file=dashboard_key,
    )
    from coordinator.dashboard.launch import broker_dashboard, run_directory_dashboard

    say = console.print
    try:
        if run is not None:
            context = run_directory_dashboard(settings, run, say)
        else:
            access = _access(flags)
            context = broker_dashboard(settings, access.broker_settings(broker or ""), fleet, say)
        with context:
            wait_for_interrupt()
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)


def _access(flags: dict[str, Any]) -> BrokerAccess:
    """The broker credentials and TLS options the fleet commands share, as given.

    Raises:
        SettingsError: a value of the wrong kind.
    """
    try:
        return BrokerAccess.model_validate({k: v for k, v in flags.items() if v is not None})
    except ValidationError as error:
        raise SettingsError(describe_settings_error(error)) from None
