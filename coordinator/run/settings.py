"""The coordinator's configuration: one pydantic-settings model per program.

Precedence, highest first: command-line flags, `PFL_*` environment variables, the TOML file given
with `--config`, then the defaults below. Each feature's settings form a section
(coordinator/run/sections.py): `[dp]`, `[secagg]`, `[async]`, `[guard]`, `[compress]`, `[sim]`,
`[dashboard]`; their flat names (`dp_clip`) work everywhere too. The TOML file may also hold the
tables `[algorithm_options]` (algorithm hyperparameters, e.g. `mu = 0.1`) and `[task_options]`.
Every field here is also a flag of the command its model configures (`protocols.settings_options`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from coordinator.dashboard.settings import DashboardSettings
from coordinator.engine.round_types import EngineSettings
from coordinator.run.sections import (
    AsyncOptions,
    CompressOptions,
    DashboardOptions,
    DpOptions,
    GuardOptions,
    SecaggOptions,
    SimOptions,
    model_help,
)
from coordinator.scheduling.async_settings import AsyncSettings
from coordinator.scheduling.availability import SimulatedClock
from coordinator.stages.aggregate_guard import GuardSettings
from coordinator.tier.settings import TierOptions, TierSettings
from pfl_tasks.base import Task
from pfl_tasks.partition_settings import PartitionSettings
from pfl_tasks.registry import options_with_model
from protocols.algorithms import (
    AlgorithmConfig,
    NormStats,
    PersonalPreset,
    algorithm_names,
    parse_algorithm_config,
)
from protocols.messages import Compression
from protocols.privacy import PrivacySettings
from protocols.program_settings import BROKER_PANEL, BrokerAccess, TomlSettings
from protocols.secure_aggregation import SecureAggregationSettings
from protocols.settings_sections import panel

_EXPORT = "Export"
_ATTACK = "Simulated attack"

SimulatedAttack = Literal["none", "sign-flip", "scaling", "alie", "ipm", "label-flip", "free-rider"]
"""`device_agent.attacks.ATTACKS`, or none (the layers keep the agent out of the settings)."""


class RunSettings(TomlSettings):
    """What a federated run trains: task, algorithm, data split and local-training settings."""

    task: str = Field(
        "digits",
        description="digits, synthetic, gaussian, sine, mnist1d, digits-image or module:attribute",
    )
    model: str | None = Field(None, description=model_help())
    algorithm: str = Field("fedavg", description=", ".join(algorithm_names()))
    rounds: int = Field(10, ge=1, description="training rounds")
    seed: int = Field(0, ge=0, description="seed of data, init, sampling, training")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of devices per round")
    local_epochs: int | None = Field(
        None, ge=1, description="local epochs per round (default: the algorithm's, 1)"
    )
    batch_size: int | None = Field(
        None, ge=1, description="local minibatch size (default: the algorithm's, 10)"
    )
    lr: float | None = Field(
        None, gt=0, description="local learning rate (default: the algorithm's, 0.1)"
    )
    personal: list[str] | None = Field(
        None, description="personal parameter pattern, repeatable (default: the algorithm's)"
    )
    personal_preset: PersonalPreset | None = Field(
        None,
        description="personal part by preset: output, input, split-input, adapters, fedbn, all, "
        "none",
    )
    norm_stats: NormStats = Field(
        "personal",
        description="normalization statistics (BatchNorm running mean/var): personal (stay on "
        "each device, FedBN) or shared (averaged like parameters); counters never leave",
    )
    pretrain_rounds: int = Field(
        0, ge=0, description="FedAvg rounds first; personal parts then warm-start from them"
    )
    eval_every: int = Field(0, ge=0, description="evaluate every N rounds, 0 = at the end")
    guard: GuardOptions = Field(default_factory=GuardOptions)
    compress: CompressOptions = Field(default_factory=CompressOptions)
    dp: DpOptions = Field(default_factory=DpOptions)
    secagg: SecaggOptions = Field(default_factory=SecaggOptions)
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync (rounds) or async (buffered asynchronous aggregation)"
    )
    asynchronous: AsyncOptions = Field(default_factory=AsyncOptions)
    tier: TierOptions = Field(default_factory=TierOptions)
    fleet: str = Field(
        "default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="fleet name"
    )
    out: Path | None = Field(None, description="run directory for metrics.jsonl and summary.json")
    algorithm_options: dict[str, Any] = Field(default_factory=dict)
    task_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _model_into_task_options(self) -> RunSettings:
        """`--model` becomes the task's `model` option, checked against the models it offers."""
        self.task_options = options_with_model(self.task, self.task_options, self.model)
        return self

    def async_settings(self) -> AsyncSettings | None:
        """Buffered asynchronous aggregation's settings (None for synchronous rounds)."""
        return self.asynchronous.async_settings() if self.mode == "async" else None

    def uplink(self) -> Compression:
        """The codec devices encode their updates with (`protocols.compression`)."""
        return self.compress.uplink()

    def guard_settings(self) -> GuardSettings:
        """The bounds on one device's influence (coordinator/stages/aggregate_guard.py).

        Under DP every update is clipped and weighs the same, and the screen's norm cut (which
        depends on the other devices' norms) would break the accountant's sensitivity bound; an
        algorithm whose updates move different models has no norm cut either. These are the
        guard's declared resolutions (coordinator/stages/features.py, docs/compatibility.md); a
        run that sets the flags they turn off is refused by the compatibility check.
        """
        return self.guard.guard_settings(
            private=self.privacy() is not None or self.secagg.enabled,  # secagg: one sum
            comparable=self.algorithm_config().comparable_update_norms,
        )

    def engine_settings(self, task: Task, rounds: int) -> EngineSettings:
        """How the round engine runs `rounds` rounds of `task` (pretraining included)."""
        return EngineSettings(
            fleet=self.fleet,
            task=task.name,
            metric=task.metric_name,
            rounds=rounds,
            eval_every=self.eval_every,
            seed=self.seed,
            guard=self.guard_settings(),
            uplink=self.uplink(),
            downlink=self.compress.down,
        )

    def tier_settings(self) -> TierSettings | None:
        """The aggregator tier's settings (None without --tier-aggregators)."""
        return self.tier.tier_settings()

    def secure_aggregation(self) -> SecureAggregationSettings | None:
        """The run's secure aggregation (None without --secagg)."""
        return self.secagg.secure_aggregation(
            self.guard.max_weight_share, int8=self.uplink().codec == "int8"
        )

    def privacy(self) -> PrivacySettings | None:
        """The run's differential privacy (None without --dp-noise).

        Raises:
            ValueError: invalid DP options.
        """
        return self.dp.privacy_settings(asynchronous=self.mode == "async")

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
            "personal_preset": self.personal_preset,
            "norm_stats": self.norm_stats,
        }
        values: dict[str, Any] = {key: value for key, value in common.items() if value is not None}
        values.update(self.algorithm_options)
        return parse_algorithm_config(self.algorithm, values)


class SimulationSettings(RunSettings, PartitionSettings):
    """`pfl-coord simulate`: virtual devices on this machine, splitting the task's data."""

    devices: int = Field(20, ge=1, description="virtual devices")
    stateless: bool = Field(False, description="devices rebuild personal parts every round")
    transport: Literal["inprocess", "mqtt"] = Field("inprocess", description="inprocess or mqtt")
    workers: int = Field(
        0,
        ge=0,
        description="processes running the virtual devices, 0 = one per available core; "
        "results do not depend on it",
    )
    batched: Literal["auto", "on", "off"] = Field(
        "auto",
        description="train each process's devices of a round as one stacked computation: auto "
        "(where a step is cheap), on, or off; results equal the per-device path's to float32 "
        "rounding (off: bit for bit what a real fleet computes)",
    )
    broker: str | None = Field(
        None, description="with --transport mqtt: mqtt:// URL (default: embedded)"
    )
    export_dir: Path | None = Field(
        None,
        description="after the final evaluation, export every device's ONNX model here",
        json_schema_extra=panel(_EXPORT),
    )
    export_quantize: Literal["int8"] | None = Field(
        None,
        description="with --export-dir, int8: also write <device>.int8.onnx",
        json_schema_extra=panel(_EXPORT),
    )
    export_guard: bool = Field(
        False,
        description="with --export-dir: ship the global model where it validates better",
        json_schema_extra=panel(_EXPORT),
    )
    sim: SimOptions = Field(default_factory=SimOptions)
    attack: SimulatedAttack = Field(
        "none",
        description="malicious devices' attack: sign-flip, scaling, alie, ipm, label-flip, "
        "free-rider",
        json_schema_extra=panel(_ATTACK),
    )
    malicious_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="with --attack: share of the virtual devices that lie",
        json_schema_extra=panel(_ATTACK),
    )
    attack_strength: float | None = Field(
        None,
        gt=0,
        description="scaling factor (100), ALIE z (the paper's z_max) or IPM epsilon (0.1)",
        json_schema_extra=panel(_ATTACK),
    )
    attack_speed: Literal["seed", "fastest"] = Field(
        "seed",
        description="with --attack: seed (liars' speeds drawn like any device's) or fastest (the "
        "liars get the fleet's top --sim-speeds)",
        json_schema_extra=panel(_ATTACK),
    )

    def sync_on_simulated_clock(self) -> bool:
        """Whether synchronous rounds would run on the simulated clock (any `sim_*` setting)."""
        return self.sim != SimOptions()

    def simulated_clock(
        self, device_ids: list[str], fastest: frozenset[str] = frozenset()
    ) -> SimulatedClock | None:
        """The simulated clock asynchronous runs, and sync runs with any `sim_*` setting, use.

        `fastest` (the liars, with `attack_speed` fastest) get the fleet's top speeds.

        Raises:
            ValueError: an availability that does not parse (FileNotFoundError: no trace file).
        """
        if self.mode == "sync" and not self.sync_on_simulated_clock():
            return None
        return self.sim.clock(device_ids, self.seed, fastest)


class ServeSettings(RunSettings, BrokerAccess):
    """`pfl-coord serve`: rounds with real devices over an MQTT broker."""

    broker: str | None = Field(
        None,
        description="mqtt(s):// URL; without it an embedded broker starts",
        json_schema_extra=panel(BROKER_PANEL),
    )
    host: str = Field(
        "127.0.0.1",
        description="loopback address the embedded broker binds",
        json_schema_extra=panel(BROKER_PANEL),
    )
    port: int = Field(
        1883,
        ge=0,
        le=65535,
        description="embedded broker port",
        json_schema_extra=panel(BROKER_PANEL),
    )
    min_devices: int = Field(1, ge=1, description="devices online before a round")
    round_timeout: float = Field(600.0, gt=0, description="seconds a round waits")
    quorum: float = Field(0.5, gt=0, le=1, description="fraction of selected devices needed")
    join_timeout: float = Field(3600.0, gt=0, description="seconds to wait for --min-devices")
    round_retries: int = Field(3, ge=0, description="retries of a round that missed its quorum")
    checkpoint_dir: Path = Field(Path("pfl-coord-state"), description="checkpoint directory")
    resume: bool = Field(False, description="continue from the last checkpoint")
    fresh: bool = Field(False, description="start over, replacing an earlier run's checkpoint")
    dashboard: DashboardOptions = Field(default_factory=DashboardOptions)

    def engine_settings(self, task: Task, rounds: int) -> EngineSettings:
        """The run's engine settings, with the real fleet's round deadline and quorum."""
        return replace(
            super().engine_settings(task, rounds),
            round_timeout_s=self.round_timeout,
            quorum=self.quorum,
        )

    def dashboard_settings(self) -> DashboardSettings | None:
        """How to serve the dashboard, or None without --dashboard."""
        return self.dashboard.dashboard_settings()
