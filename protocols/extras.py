"""Which packages only the coordinator's install brings, and the error a lean install gives.

`pip install pfl-edge` (or `pfl-edge[agent]`) installs what a device agent imports; the
`coord` extra adds the coordinator's packages (pyproject.toml). A command that reaches one of
those without it ends with one line naming the extra, not a traceback.
"""

from __future__ import annotations

import importlib
from typing import Final

from rich.console import Console
from rich.markup import escape

COORD_ONLY: Final = {
    "amqtt": "amqtt",
    "sklearn": "scikit-learn",
    "mnist1d": "mnist1d",
    "scipy": "scipy",
    "dp_accounting": "dp-accounting",
    "matplotlib": "matplotlib",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
}
"""Import name -> distribution of every package the `coord` extra adds (and what they pull)."""
EXTRA_LINE: Final = 'pip install "pfl-edge[coord]"'


def missing_extra(error: ModuleNotFoundError, hint: str = "") -> str | None:
    """The one-line message for a coordinator-only package missing here, or None for others."""
    top = (error.name or "").split(".")[0]
    if top not in COORD_ONLY:
        return None
    return (
        f"{COORD_ONLY[top]} is not installed: this install is the device agent's, and the "
        f"coordinator's packages come with {EXTRA_LINE}{hint}"
    )


def run_program(module: str, hint: str = "") -> None:
    """Import `module` and run its typer `app`: a console script's entry point.

    A coordinator-only package missing here, at import or in a command, ends it with one line.
    """
    try:
        importlib.import_module(module).app()
    except ModuleNotFoundError as error:
        message = missing_extra(error, hint)
        if message is None:
            raise
        Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
        raise SystemExit(2) from None
