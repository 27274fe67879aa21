"""The data-split settings, defined once for the coordinator's and the device agent's settings.

`pfl-coord simulate` and every `pfl-agent start --data-shard` split the same pooled data; if
either side's fields or defaults drifted, a device would silently train on another shard than
the simulation gives it. Both settings models inherit these fields (flags, `PFL_*` variables and
TOML keys `partition`, `alpha`, `labels_per_device`, `groups`, `fraction`).
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, Field

from pfl_tasks.base import PartitionScheme, PartitionSpec

_PANEL: Final[dict[str, Any]] = {"panel": "Data split"}
"""The `--help` panel of these flags (see `protocols.settings_sections.panel`)."""


class PartitionSettings(BaseModel):
    """How a task's pooled data is split across devices (see `PartitionSpec`)."""

    partition: PartitionScheme = Field(
        "dirichlet",
        description="iid, dirichlet, shards, powerlaw, groups",
        json_schema_extra=_PANEL,
    )
    alpha: float = Field(
        0.5, gt=0, description="Dirichlet concentration of label skew", json_schema_extra=_PANEL
    )
    labels_per_device: int = Field(
        2, ge=1, description="labels per device (shards, powerlaw)", json_schema_extra=_PANEL
    )
    groups: int = Field(
        2, ge=1, description="label groups of the groups partition", json_schema_extra=_PANEL
    )
    fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of the pooled data drawn before partitioning",
        json_schema_extra=_PANEL,
    )

    def partition_spec(self) -> PartitionSpec:
        """The split every device of the fleet, virtual or real, derives its data from."""
        return PartitionSpec(
            scheme=self.partition,
            alpha=self.alpha,
            labels_per_device=self.labels_per_device,
            groups=self.groups,
            fraction=self.fraction,
        )
