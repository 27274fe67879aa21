"""What the `pfl-coord` commands share: the options of commands without a settings model, logging.

`simulate`, `serve` and `compare` generate their options from their settings models
(`protocols.settings_options`); the fleet commands (`status`, `export`, `dashboard`) take the
broker's and the dashboard's options with the help those settings declare.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from coordinator.run.sections import DashboardOptions
from protocols.program_settings import BrokerAccess


def _broker(name: str) -> str | None:
    return BrokerAccess.model_fields[name].description


def _dashboard(name: str) -> str | None:
    return DashboardOptions.model_fields[name].description


ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with any setting (flags and PFL_* variables win)"),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")]
UserOption = Annotated[str | None, typer.Option(help=_broker("username"), envvar="PFL_USERNAME")]
PasswordOption = Annotated[
    str | None, typer.Option(help=_broker("password"), envvar="PFL_PASSWORD")
]
CaOption = Annotated[str | None, typer.Option(help=_broker("ca_file"), envvar="PFL_CA_FILE")]
CertOption = Annotated[str | None, typer.Option(help=_broker("cert_file"), envvar="PFL_CERT_FILE")]
KeyOption = Annotated[str | None, typer.Option(help=_broker("key_file"), envvar="PFL_KEY_FILE")]
InsecureOption = Annotated[
    bool | None, typer.Option("--tls-insecure", help=_broker("tls_insecure"))
]

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
