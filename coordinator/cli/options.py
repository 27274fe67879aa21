"""What the `pfl-coord` commands share: the options of commands without a settings model, logging.

Every command generates its settings' options from the models that declare them
(`protocols.settings_options`); the dashboard command's own options take the help its section
declares.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from coordinator.run.sections import DashboardOptions


def _dashboard(name: str) -> str | None:
    return DashboardOptions.model_fields[name].description


ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with any setting (flags and PFL_* variables win)"),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")]
console = Console(stderr=True)


def configure_logging(verbose: bool) -> None:
    """Rich log lines on stderr; library modules only create loggers."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )


DashboardTokenOption = Annotated[
    str | None, typer.Option(help=_dashboard("token"), envvar="PFL_DASHBOARD_TOKEN")
]
DashboardTokenFileOption = Annotated[Path | None, typer.Option(help=_dashboard("token_file"))]
DashboardCertOption = Annotated[Path | None, typer.Option(help=_dashboard("cert"))]
DashboardKeyOption = Annotated[Path | None, typer.Option(help=_dashboard("key"))]
