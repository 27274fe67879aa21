"""Command-line options both programs declare: how a task's data is split across devices.

`pfl-coord simulate` and `pfl-agent start --data-shard` / `pfl-agent pool` must split the same
pooled data the same way, so their flags are declared once (as `PartitionSettings` is).
"""

from __future__ import annotations

from typing import Annotated

import typer

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
