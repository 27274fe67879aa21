"""The device agent's configuration: flags > `PFL_*` environment > `--config` TOML > defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from device_agent.compute_threads import available_cores
from device_agent.identity import default_device_id
from device_agent.virtual_fleet import parse_device_range
from device_agent.work_limits import WorkLimits
from pfl_tasks.partition_settings import PartitionSettings
from pfl_tasks.registry import options_with_model
from protocols import topics
from protocols.program_settings import BROKER_PANEL, BrokerAccess, TomlSettings
from protocols.settings_sections import Section, panel

MODEL_HELP = (
    "the task's model, one it offers (as the coordinator's --model; `pfl-coord simulate --help` "
    "lists them); default: the task's own"
)


_ELIGIBILITY = "Round eligibility"


class ComputeSettings(BaseModel):
    """How much of this machine training may use."""

    threads: int = Field(
        0,
        ge=0,
        description="most torch threads training uses (0: the cores available); a model too "
        "small to gain from them trains on fewer",
    )

    def thread_ceiling(self) -> int:
        """The most torch threads training may use."""
        return self.threads or available_cores()


class LimitsOptions(Section):
    """The most work one round may ask of this device: `[limits]` table."""

    table = "limits"
    panel = "Round limits (limits)"

    max_epochs: int = Field(default=100, ge=1, description="decline rounds asking for more epochs")
    max_steps: int = Field(
        default=100_000, ge=1, description="most optimizer steps in one round, else decline"
    )
    max_round_seconds: float = Field(
        default=3600.0, gt=0, description="most seconds of local work in one round, else decline"
    )

    def work_limits(self) -> WorkLimits:
        """This device's ceilings on one round's work."""
        return WorkLimits(self.max_epochs, self.max_steps, self.max_round_seconds)


class AgentSettings(TomlSettings, BrokerAccess, PartitionSettings, ComputeSettings):
    """`pfl-agent start`: one real device of a fleet.

    With `data_shard`, the agent holds exactly the data a simulation device with that index
    gets (`make_fleet(num_shards, partition, seed)[data_shard]`); with `data`, its own files.
    """

    broker: str = Field(
        "mqtt://127.0.0.1:1883",
        description="mqtt(s):// URL of the broker",
        json_schema_extra=panel(BROKER_PANEL),
    )
    device_id: str = Field(
        default_factory=default_device_id,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="this device's id (default: <host name>-<machine id prefix>)",
    )
    fleet: str = Field(
        "default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="fleet name"
    )
    task: str = Field("digits", description="task name or module:attribute")
    model: str | None = Field(None, description=MODEL_HELP)
    task_options: dict[str, Any] = Field(default_factory=dict)
    data_shard: int | None = Field(
        None, ge=0, description="index of this device's shard of the task's data"
    )
    num_shards: int = Field(20, ge=1, description="shards in all")
    seed: int = Field(0, ge=0, description="the run's seed")
    data: Path | None = Field(
        None, description="directory with train/test/val.npz instead of a shard"
    )
    state_dir: Path = Field(Path("pfl-agent-state"), description="personal state directory")
    stateless: bool = Field(False, description="keep no personal state")
    min_free_memory: str | None = Field(
        None,
        description="skip a round when less memory is free (200MB, 10%)",
        json_schema_extra=panel(_ELIGIBILITY),
    )
    max_load_per_core: float | None = Field(
        None,
        gt=0,
        description="skip a round when the load per core is higher",
        json_schema_extra=panel(_ELIGIBILITY),
    )
    require_mains_power: bool = Field(
        False, description="skip rounds while on battery", json_schema_extra=panel(_ELIGIBILITY)
    )
    memory_budget: str | None = Field(
        None,
        description="training memory cap: 512MB, 1.5GiB, 70% or 0.7 of available memory",
        json_schema_extra=panel(_ELIGIBILITY),
    )
    limits: LimitsOptions = Field(default_factory=LimitsOptions)
    max_takeovers: int = Field(
        3,
        ge=0,
        description="exit after this many connections in a row lost to another client with "
        "this device id, 0 = never",
    )
    dp_strict_egress: bool = Field(
        False,
        description="release nothing outside DP's guarantee: declare 1 sample, train only in "
        "DP rounds, decline evaluations, no metrics or reasons in reports",
    )

    def work_limits(self) -> WorkLimits:
        """This device's ceilings on one round's work."""
        return self.limits.work_limits()

    @field_validator("device_id")
    @classmethod
    def _not_reserved(cls, device_id: str) -> str:
        problem = topics.device_id_problem(device_id)
        if problem is not None:
            raise ValueError(problem)
        return device_id

    @model_validator(mode="after")
    def _model_into_task_options(self) -> AgentSettings:
        self.task_options = options_with_model(self.task, self.task_options, self.model)
        return self

    @model_validator(mode="after")
    def _check_data_source(self) -> AgentSettings:
        if self.data is None and self.data_shard is None:
            msg = "give --data-shard (a shard of the task's data) or --data DIR (your own data)"
            raise ValueError(msg)
        if self.data_shard is not None and self.data_shard >= self.num_shards:
            msg = f"data_shard {self.data_shard} must be below num_shards {self.num_shards}"
            raise ValueError(msg)
        return self


class PoolSettings(TomlSettings, BrokerAccess, PartitionSettings, ComputeSettings):
    """`pfl-agent pool`: a range of a simulated fleet's virtual devices, each a real MQTT client.

    Device `i` holds `make_fleet(num_shards, partition, seed)[i]`, as in `pfl-coord simulate`,
    so pools on several machines together are the simulation's fleet.
    """

    devices: str = Field(
        description="this pool's virtual devices, e.g. 0-249 (first-last, inclusive; at most 300)"
    )
    num_shards: int = Field(
        ge=1, description="devices in the whole simulated fleet, over all pools"
    )
    broker: str = Field(
        "mqtt://127.0.0.1:1883",
        description="mqtt(s):// URL of the broker",
        json_schema_extra=panel(BROKER_PANEL),
    )
    fleet: str = Field(
        "default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="fleet name"
    )
    task: str = Field("digits", description="task name or module:attribute")
    model: str | None = Field(None, description=MODEL_HELP)
    task_options: dict[str, Any] = Field(default_factory=dict)
    seed: int = Field(0, ge=0, description="the run's seed")
    stateless: bool = Field(False, description="keep no personal state")

    @model_validator(mode="after")
    def _model_into_task_options(self) -> PoolSettings:
        self.task_options = options_with_model(self.task, self.task_options, self.model)
        return self

    @model_validator(mode="after")
    def _check_range(self) -> PoolSettings:
        last = self.device_range()[-1]
        if last >= self.num_shards:
            msg = (
                f"--devices {self.devices} reaches device {last}, but the fleet has "
                f"{self.num_shards} (--num-shards): devices are numbered 0-{self.num_shards - 1}"
            )
            raise ValueError(msg)
        return self

    def device_range(self) -> range:
        """The indices of this pool's devices."""
        return parse_device_range(self.devices)
