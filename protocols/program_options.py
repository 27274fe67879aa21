"""Command-line options both programs declare: how a task's data is split across devices.

`pfl-coord simulate` and `pfl-agent start --data-shard` / `pfl-agent pool` must split the same
pooled data the same way, so their flags are declared once (as `PartitionSettings` is).
"""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

PartitionOption = Annotated[
    str | None,
    typer.Option(help="iid, dirichlet, shards, powerlaw, groups (default: dirichlet)"),
]
AlphaOption = Annotated[float | None, typer.Option(help="Dirichlet concentration (default: 0.5)")]
LabelsOption = Annotated[
    int | None, typer.Option(help="labels per device for shards/powerlaw (default: 2)")
]
GroupsOption = Annotated[
    int | None, typer.Option(help="label groups for the groups partition (default: 2)")
]
FractionOption = Annotated[
    float | None,
    typer.Option(help="share of the pooled data drawn before partitioning (default: 1.0)"),
]


def exit_with_error(console: Console, error: BaseException, code: int = 2) -> NoReturn:
    """Print `error:` and the error's own words on one line (no wrapping, no markup), then exit.

    A long message wrapped at the terminal's width reads as two problems; an error naming
    `[brackets]` must not be taken for markup.
    """
    console.print(f"[red]error:[/red] {escape(str(error))}", soft_wrap=True)
    raise typer.Exit(code) from None
