"""`pfl-agent`: the device agent's command line (thin: it parses, calls the library, reports)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from device_agent.runner import run_agent
from device_agent.settings import AgentSettings
from device_agent.state_store import DiskStateStore
from protocols.errors import PflError

app = typer.Typer(
    help="pfl-edge device agent: train personalized models on this device.", no_args_is_help=True
)
console = Console(stderr=True)


@app.command()
def start(
    broker: Annotated[
        str | None, typer.Option(help="mqtt(s):// URL (default: mqtt://127.0.0.1:1883)")
    ] = None,
    device_id: Annotated[str | None, typer.Option(help="this device's id (required)")] = None,
    fleet: Annotated[str | None, typer.Option(help="fleet name (default: default)")] = None,
    task: Annotated[str | None, typer.Option(help="task name or module:attribute")] = None,
    data_shard: Annotated[
        int | None, typer.Option(help="index of this device's shard of the task's data")
    ] = None,
    num_shards: Annotated[int | None, typer.Option(help="shards in all (default: 20)")] = None,
    partition: Annotated[
        str | None, typer.Option(help="iid, dirichlet, shards, powerlaw (default: dirichlet)")
    ] = None,
    alpha: Annotated[
        float | None, typer.Option(help="Dirichlet concentration (default: 0.5)")
    ] = None,
    labels_per_device: Annotated[
        int | None, typer.Option(help="labels per device for shards/powerlaw (default: 2)")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="the run's seed (default: 0)")] = None,
    data: Annotated[
        Path | None, typer.Option(help="directory with train/test/val.npz instead of a shard")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="personal state directory (default: ./pfl-agent-state)")
    ] = None,
    stateless: Annotated[
        bool | None, typer.Option("--stateless", help="keep no personal state")
    ] = None,
    username: Annotated[str | None, typer.Option(help="broker user name")] = None,
    password: Annotated[str | None, typer.Option(help="broker password (or PFL_PASSWORD)")] = None,
    ca_file: Annotated[str | None, typer.Option(help="CA file for mqtts:// brokers")] = None,
    cert_file: Annotated[str | None, typer.Option(help="client certificate")] = None,
    key_file: Annotated[str | None, typer.Option(help="client certificate's key")] = None,
    tls_insecure: Annotated[
        bool | None, typer.Option("--tls-insecure", help="skip the host name check")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="TOML file with any setting (flags and PFL_* win)")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    """Join a fleet and train in its rounds until SIGTERM or Ctrl-C.

    Every flag can also be set as a PFL_<NAME> environment variable or in the --config file.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    values = {k: v for k, v in locals().items() if k not in ("config", "verbose")}
    try:
        settings = AgentSettings.load(config, **values)
        run_agent(settings)
    except (PflError, ValueError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None


@app.command("reset-state")
def reset_state(
    state_dir: Annotated[Path, typer.Option(help="the agent's state directory")],
) -> None:
    """Delete this device's personal state (it starts from the task's initialization next round)."""
    DiskStateStore(state_dir).clear()
    console.print(f"personal state in {state_dir} cleared")


@app.callback()
def main() -> None:
    """pfl-edge device agent."""


if __name__ == "__main__":
    app()
