"""The coordinator's configuration: one pydantic-settings model per program.

Precedence, highest first: command-line flags, `PFL_*` environment variables, the TOML file given
with `--config`, then the defaults below. The TOML file may also hold the tables
`[algorithm_options]` (algorithm hyperparameters, e.g. `mu = 0.1`) and `[task_options]`.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from protocols.algorithms import AlgorithmConfig, parse_algorithm_config
from tasks.base import PartitionSpec

SettingsT = TypeVar("SettingsT", bound="_TomlSettings")
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("pfl_config_file", default=None)


class _TomlSettings(BaseSettings):
    """Shared loading rules: flags > PFL_* environment > TOML file > defaults."""

    model_config = SettingsConfigDict(env_prefix="PFL_", extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        del dotenv_settings, file_secret_settings
        path = _CONFIG_FILE.get()
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=path))

    @classmethod
    def load(cls: type[SettingsT], config_file: Path | None = None, **overrides: Any) -> SettingsT:
        """Settings from flags (`overrides`, None meaning "not given"), environment and file.

        Raises:
            FileNotFoundError: `config_file` does not exist.
        """
        if config_file is not None and not Path(config_file).is_file():
            msg = f"config file not found: {config_file}"
            raise FileNotFoundError(msg)
        token = _CONFIG_FILE.set(config_file)
        try:
            return cls(**{key: value for key, value in overrides.items() if value is not None})
        finally:
            _CONFIG_FILE.reset(token)


class RunSettings(_TomlSettings):
    """What a federated run trains: task, algorithm, data split and local-training settings."""

    task: str = Field("digits", description="built-in task name or module:attribute")
    algorithm: str = Field("fedavg", description="algorithm name")
    rounds: int = Field(10, ge=1, description="training rounds")
    seed: int = Field(0, ge=0, description="seed of data, model init, sampling and training")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of devices per round")
    local_epochs: int | None = Field(None, ge=1, description="local epochs (algorithm default)")
    batch_size: int | None = Field(None, ge=1, description="minibatch size (algorithm default)")
    lr: float | None = Field(None, gt=0, description="local learning rate (algorithm default)")
    personal: list[str] | None = Field(None, description="personal parameter patterns")
    eval_every: int = Field(0, ge=0, description="evaluate every N rounds (0: at the end only)")
    fleet: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    out: Path | None = Field(None, description="run directory for metrics.jsonl and summary.json")
    algorithm_options: dict[str, Any] = Field(default_factory=dict)
    task_options: dict[str, Any] = Field(default_factory=dict)

    def algorithm_config(self) -> AlgorithmConfig:
        """The typed algorithm config; `[algorithm_options]` values win over the common flags.

        Raises:
            ValueError: unknown algorithm or invalid hyperparameters.
        """
        common = {
            "local_epochs": self.local_epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "personal": tuple(self.personal) if self.personal is not None else None,
        }
        values: dict[str, Any] = {key: value for key, value in common.items() if value is not None}
        values.update(self.algorithm_options)
        return parse_algorithm_config(self.algorithm, values)


class SimulationSettings(RunSettings):
    """`pfl-coord simulate`: virtual devices on this machine."""

    devices: int = Field(20, ge=1, description="virtual devices")
    partition: Literal["iid", "dirichlet", "shards", "powerlaw"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration of label skew")
    labels_per_device: int = Field(2, ge=1, description="labels per device (shards, powerlaw)")
    transport: Literal["inprocess", "mqtt"] = "inprocess"
    broker: str | None = Field(None, description="mqtt:// URL; embedded broker if not given")

    def partition_spec(self) -> PartitionSpec:
        """How the task's data is split across the virtual devices."""
        return PartitionSpec(
            scheme=self.partition, alpha=self.alpha, labels_per_device=self.labels_per_device
        )
