"""The aggregator tier's settings: the coordinator's `[tier]`, `pfl-coord aggregator`'s own."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, field_validator

from protocols.program_settings import BROKER_PANEL, BrokerAccess, TomlSettings
from protocols.settings_sections import Section, panel

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def _names(value: str) -> str:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if len(set(names)) != len(names):
        msg = f"aggregator names must be unique: {value!r}"
        raise ValueError(msg)
    return ",".join(names)


@dataclass(frozen=True)
class TierSettings:
    """What the coordinator's tier path needs."""

    aggregators: tuple[str, ...]
    clip_norm: float
    grace_s: float


class TierOptions(Section):
    """Hierarchical aggregation through aggregators: `--tier-*` flags, `[tier]` table."""

    table = "tier"
    flag_prefix = "tier_"
    panel = "Aggregator tier (tier)"

    aggregators: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_.,\- ]*$",
        description="tier: the aggregators whose partial aggregates the coordinator combines, "
        "comma-separated (empty: off; a simulation runs them, each serving the devices hashed "
        "to it)",
    )
    clip: float = Field(
        default=10.0,
        gt=0,
        description="tier: L2 clip norm an aggregator applies to each update without DP",
    )
    grace: float = Field(
        default=10.0,
        gt=0,
        description="tier: seconds the coordinator waits for partials after closing a round",
    )

    @field_validator("aggregators")
    @classmethod
    def _unique(cls, value: str) -> str:
        return _names(value)

    def names(self) -> tuple[str, ...]:
        """The aggregators' names (empty: the tier is off)."""
        return tuple(name for name in self.aggregators.split(",") if name)

    def tier_settings(self) -> TierSettings | None:
        """The tier path's settings (None: off)."""
        names = self.names()
        if not names:
            return None
        return TierSettings(names, self.clip, self.grace)


class AggregatorSettings(TomlSettings, BrokerAccess):
    """`pfl-coord aggregator`: serve one group of devices and send its partial aggregates."""

    broker: str | None = Field(
        None,
        description="mqtt(s):// URL of the site's broker (required)",
        json_schema_extra=panel(BROKER_PANEL),
    )
    name: str | None = Field(
        None,
        pattern=_NAME,
        description="this aggregator's name, as --tier-aggregators lists it (required)",
    )
    fleet: str = Field("default", pattern=_NAME, description="fleet name")
    devices: list[str] = Field(
        default_factory=list,
        description="the group by an explicit site list of device ids, repeatable",
    )
    groups: int = Field(
        0, ge=0, description="the group by hash: this many groups in all (with --index)"
    )
    index: int = Field(0, ge=0, description="the group by hash: this aggregator's group")
    quarantine_after: int = Field(
        3, ge=1, description="bad messages after which a device sits out the round"
    )

    def problem(self) -> str | None:
        """What is missing or contradictory (None: nothing)."""
        if self.broker is None or self.name is None:
            return "give --broker and --name (flags, PFL_* variables or the --config file)"
        if bool(self.devices) == bool(self.groups):
            return "give the group either as --devices or as --groups with --index"
        if self.groups and self.index >= self.groups:
            return f"--index {self.index} is not below --groups {self.groups}"
        return None
