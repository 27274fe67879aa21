"""`pfl-agent`: the device agent's command line (thin: it parses, calls the library, reports)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from device_agent.state_store import DiskStateStore

app = typer.Typer(
    help="pfl-edge device agent: train personalized models on this device.", no_args_is_help=True
)
console = Console(stderr=True)


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
