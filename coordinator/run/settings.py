"""The coordinator's configuration: one pydantic-settings model per program.

Precedence, highest first: command-line flags, `PFL_*` environment variables, the TOML file given
with `--config`, then the defaults below. The TOML file may also hold the tables
`[algorithm_options]` (algorithm hyperparameters, e.g. `mu = 0.1`) and `[task_options]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from coordinator.dashboard.settings import DashboardSettings
from coordinator.scheduling.async_settings import AsyncSettings
from coordinator.scheduling.availability import (
    AvailabilitySpec,
    DeviceTiming,
    SimulatedClock,
    parse_speeds,
)
from coordinator.scheduling.staleness import StalenessRule
from coordinator.stages.aggregate_guard import GuardSettings
from pfl_tasks.partition_settings import PartitionSettings
from protocols.algorithms import AlgorithmConfig, PersonalPreset, parse_algorithm_config
from protocols.messages import Compression
from protocols.privacy import Distribution, Mechanism, Placement, PrivacySettings, Sampling
from protocols.program_settings import BrokerAccess, TomlSettings
from protocols.secure_aggregation import SecureAggregationSettings

SimulatedAttack = Literal["none", "sign-flip", "scaling", "alie", "ipm", "label-flip", "free-rider"]
"""`device_agent.attacks.ATTACKS`, or none (the layers keep the agent out of the settings)."""


class RunSettings(TomlSettings):
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
    personal_preset: PersonalPreset | None = Field(
        None, description="personal part by the paper's presets (output, input, adapters, ...)"
    )
    pretrain_rounds: int = Field(
        0, ge=0, description="FedAvg rounds before the algorithm; personal parts warm-start"
    )
    eval_every: int = Field(0, ge=0, description="evaluate every N rounds (0: at the end only)")
    max_count_ratio: float = Field(
        3.0, ge=0, description="count no device above this x the round's lower median (0: off)"
    )
    count_spread_power: float = Field(
        4.0, ge=0, description="where counts spread, that multiple widens to (Q3/Q1)^this"
    )
    max_weight_share: float = Field(
        0.5, gt=0, le=1, description="no device weighs more than this share of a round"
    )
    norm_bound: float = Field(
        4.0, ge=0, description="clip updates to this x the round's lower median norm (0: off)"
    )
    max_samples: int = Field(
        100_000_000, ge=1, description="most training samples a device may declare"
    )
    quarantine_after: int = Field(
        64, ge=0, description="dropped messages before a device sits out the round (0: off)"
    )
    compress: str = Field(
        "none", description="how devices send updates: none, int8, int8:stochastic, topk:<f>"
    )
    compress_down: Literal["none", "int8"] = Field(
        "none", description="send models as int8 deltas to devices holding the previous one"
    )
    dp_noise: float | None = Field(
        None, ge=0, description="differential privacy: noise multiplier z (unset: no DP)"
    )
    dp_clip: float = Field(1.0, gt=0, description="DP: clip norm of each shared delta")
    dp_placement: Placement = Field("coordinator", description="DP: who adds the noise")
    dp_distribution: Distribution = Field(
        "gaussian", description="DP: gaussian, or discrete-gaussian in the secagg ring (device)"
    )
    dp_sampling: Sampling | None = Field(
        None, description="DP: how each round's cohort is drawn (unset: poisson for dp-fedavg)"
    )
    dp_mechanism: Mechanism = Field("dp-fedavg", description="DP: fresh noise or DP-FTRL's tree")
    dp_delta: float = Field(1e-5, gt=0, lt=1, description="DP: the delta epsilon is reported at")
    dp_epsilon: float | None = Field(None, gt=0, description="DP: the epsilon budget")
    dp_on_budget: Literal["stop", "warn"] = Field("stop", description="DP: at the budget")
    dp_adaptive_clip: bool = Field(False, description="DP: move the clip to a norm quantile")
    dp_options: dict[str, Any] = Field(
        default_factory=dict, description="[dp_options]: target_quantile, clip_learning_rate"
    )
    secagg: bool = Field(False, description="secure aggregation: the coordinator sees only sums")
    secagg_neighbors: int = Field(
        0, ge=0, description="secagg: masking neighbours per device (0: all selected, SecAgg)"
    )
    secagg_threshold: float = Field(
        0.6, gt=0.5, le=1, description="secagg: share of neighbours needed to unmask"
    )
    secagg_clip: float = Field(10.0, gt=0, description="secagg: clip norm of each delta (no DP)")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: rounds; async: buffered asynchronous aggregation (FedBuff)"
    )
    buffer: int = Field(10, ge=1, description="async: updates per aggregation (K)")
    max_staleness: int = Field(
        10, ge=0, description="async: drop updates more aggregations behind than this"
    )
    staleness: str = Field(
        "poly:0.5", description="async: staleness weight: constant, poly[:a], hinge[:a[:b]]"
    )
    concurrency: int = Field(
        0, ge=0, description="async: devices training at once (0: participation x fleet)"
    )
    fair_share: float = Field(
        2.0,
        ge=0,
        description="async: no device weighs over this x its fair share of buffers (0: off)",
    )
    fair_share_window: int = Field(
        20, ge=1, description="async: aggregations the fair share is counted over"
    )
    fleet: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    out: Path | None = Field(None, description="run directory for metrics.jsonl and summary.json")
    algorithm_options: dict[str, Any] = Field(default_factory=dict)
    task_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("compress")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        return str(Compression.parse(value))

    @field_validator("staleness")
    @classmethod
    def _known_staleness(cls, value: str) -> str:
        return str(StalenessRule.parse(value))

    @field_validator("fair_share")
    @classmethod
    def _fair_share_off_or_at_least_one(cls, value: float) -> float:
        if 0 < value < 1:
            msg = "fair_share: 0 (off) or at least 1 (a multiple of the fair share)"
            raise ValueError(msg)
        return value

    def async_settings(self) -> AsyncSettings | None:
        """Buffered asynchronous aggregation's settings (None for synchronous rounds)."""
        if self.mode != "async":
            return None
        return AsyncSettings(
            buffer=self.buffer,
            max_staleness=self.max_staleness,
            staleness=StalenessRule.parse(self.staleness),
            concurrency=self.concurrency,
            fair_share=self.fair_share,
            fair_share_window=self.fair_share_window,
        )

    def uplink(self) -> Compression:
        """The codec devices encode their updates with (`protocols.compression`)."""
        return Compression.parse(self.compress)

    def guard_settings(self) -> GuardSettings:
        """The bounds on one device's influence (coordinator/stages/aggregate_guard.py).

        Under DP every update is clipped and weighs the same, and the screen's norm cut (which
        depends on the other devices' norms) would break the accountant's sensitivity bound; an
        algorithm whose updates move different models has no norm cut either.
        """
        private = self.privacy() is not None or self.secagg  # secagg: the sum is one update
        comparable = self.algorithm_config().comparable_update_norms
        return GuardSettings(
            max_samples=self.max_samples,
            max_count_ratio=0.0 if private else self.max_count_ratio,
            count_spread_power=self.count_spread_power,
            max_weight_share=1.0 if private else self.max_weight_share,
            norm_bound=self.norm_bound if comparable and not private else 0.0,
            quarantine_after=self.quarantine_after,
        )

    def secure_aggregation(self) -> SecureAggregationSettings | None:
        """The run's secure aggregation (None without --secagg)."""
        if not self.secagg:
            return None
        return SecureAggregationSettings(
            threshold=self.secagg_threshold,
            neighbors=self.secagg_neighbors,
            clip_norm=self.secagg_clip,
            max_weight_share=self.max_weight_share,
            int8=self.uplink().codec == "int8",
        )

    def privacy(self) -> PrivacySettings | None:
        """The run's differential privacy (None without --dp-noise).

        Raises:
            ValueError: invalid DP options.
        """
        if self.dp_noise is None:
            return None
        return PrivacySettings(
            noise_multiplier=self.dp_noise,
            clip_norm=self.dp_clip,
            placement=self.dp_placement,
            distribution=self.dp_distribution,
            sampling=self.dp_sampling
            or ("poisson" if self.dp_mechanism == "dp-fedavg" else "fixed"),
            mechanism=self.dp_mechanism,
            delta=self.dp_delta,
            target_epsilon=self.dp_epsilon,
            on_budget=self.dp_on_budget,
            adaptive_clipping=self.dp_adaptive_clip,
            **self.dp_options,
        )

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
        }
        values: dict[str, Any] = {key: value for key, value in common.items() if value is not None}
        values.update(self.algorithm_options)
        return parse_algorithm_config(self.algorithm, values)


class SimulationSettings(RunSettings, PartitionSettings):
    """`pfl-coord simulate`: virtual devices on this machine, splitting the task's data."""

    devices: int = Field(20, ge=1, description="virtual devices")
    stateless: bool = Field(False, description="devices keep no personal state between rounds")
    transport: Literal["inprocess", "mqtt"] = "inprocess"
    workers: int = Field(
        0, ge=0, description="processes running the virtual devices (0: one per available core)"
    )
    broker: str | None = Field(None, description="mqtt:// URL; embedded broker if not given")
    export_dir: Path | None = Field(
        None, description="after the final evaluation, export every device's model here"
    )
    export_quantize: Literal["int8"] | None = Field(
        None, description="with export_dir: also write <device>.int8.onnx"
    )
    export_guard: bool = Field(
        False, description="with export_dir: ship the global model where it validates better"
    )
    sim_speeds: str = Field(
        "equal", description="device speeds: equal, or lognormal:<ratio of fastest 5% to slowest>"
    )
    sim_availability: str = Field(
        "always", description="always, diurnal[:on_fraction[:period_s]] or trace:<sessions.csv>"
    )
    sim_uptime: float = Field(
        0.0, ge=0, description="mean simulated seconds online between random dropouts (0: none)"
    )
    sim_downtime: float = Field(300.0, ge=0, description="simulated seconds offline per dropout")
    sim_seconds_per_sample: float = Field(
        0.01, gt=0, description="simulated seconds per sample and epoch at speed 1"
    )
    sim_latency: float = Field(1.0, ge=0, description="simulated seconds per job beyond training")
    sim_deadline: float = Field(
        0.0, ge=0, description="sync: a round's deadline in simulated seconds (0: none)"
    )
    attack: SimulatedAttack = Field(
        "none", description="malicious virtual devices' attack (device_agent/attacks.py)"
    )
    malicious_fraction: float = Field(
        0.0, ge=0, lt=1, description="with attack: share of the virtual devices that lie"
    )
    attack_strength: float | None = Field(
        None, gt=0, description="scaling factor, ALIE z or IPM epsilon (default per attack)"
    )
    attack_speed: Literal["seed", "fastest"] = Field(
        "seed", description="with attack: liars' speeds from the seed, or the fleet's fastest"
    )

    @field_validator("sim_speeds")
    @classmethod
    def _known_speeds(cls, value: str) -> str:
        parse_speeds(value)
        return value

    def simulated_clock(
        self, device_ids: list[str], fastest: frozenset[str] = frozenset()
    ) -> SimulatedClock | None:
        """The simulated clock asynchronous runs, and sync runs with any `sim_*` setting, use.

        `fastest` (the liars, with `attack_speed` fastest) get the fleet's top speeds.

        Raises:
            ValueError: an availability that does not parse (FileNotFoundError: no trace file).
        """
        defaults = {
            name: field.default
            for name, field in SimulationSettings.model_fields.items()
            if name.startswith("sim_")
        }
        realistic = any(getattr(self, name) != value for name, value in defaults.items())
        if self.mode == "sync" and not realistic:
            return None
        return SimulatedClock(
            device_ids,
            self.seed,
            speed_ratio=parse_speeds(self.sim_speeds),
            availability=AvailabilitySpec.parse(
                self.sim_availability, self.sim_uptime, self.sim_downtime
            ),
            timing=DeviceTiming(self.sim_seconds_per_sample, self.sim_latency),
            deadline_s=self.sim_deadline,
            fastest=fastest,
        )


class ServeSettings(RunSettings, BrokerAccess):
    """`pfl-coord serve`: rounds with real devices over an MQTT broker."""

    broker: str | None = Field(None, description="mqtt:// URL; embedded broker if not given")
    host: str = Field("127.0.0.1", description="loopback address the embedded broker binds")
    port: int = Field(1883, ge=0, le=65535, description="port of the embedded broker")
    min_devices: int = Field(1, ge=1, description="devices that must be online before a round")
    round_timeout: float = Field(600.0, gt=0, description="seconds a round waits for updates")
    quorum: float = Field(0.5, gt=0, le=1, description="fraction of selected devices required")
    join_timeout: float = Field(3600.0, gt=0, description="seconds to wait for min_devices")
    round_retries: int = Field(3, ge=0, description="retries of a round that missed its quorum")
    checkpoint_dir: Path = Field(Path("pfl-coord-state"), description="checkpoint directory")
    resume: bool = Field(False, description="continue from the last checkpoint")
    fresh: bool = Field(
        False, description="start over, replacing an earlier run's checkpoint and metrics"
    )
    dashboard: str | None = Field(
        None, description="HOST:PORT to serve the live web dashboard on (e.g. 127.0.0.1:8080)"
    )
    dashboard_token: str | None = Field(
        None, description="token the dashboard asks of browsers (made up per run when not given)"
    )
    dashboard_token_file: Path | None = Field(
        None, description="file the dashboard's token is written to (mode 0600)"
    )
    dashboard_open_to_local_users: bool = Field(
        False, description="no dashboard token on loopback: every local user reads the fleet"
    )
    dashboard_cert: Path | None = Field(None, description="TLS certificate for the dashboard")
    dashboard_key: Path | None = Field(None, description="the dashboard certificate's key")

    def dashboard_settings(self) -> DashboardSettings | None:
        """How to serve the dashboard, or None without --dashboard."""
        if self.dashboard is None:
            return None
        return DashboardSettings(
            listen=self.dashboard,
            token=self.dashboard_token,
            token_file=self.dashboard_token_file,
            open_to_local_users=self.dashboard_open_to_local_users,
            cert_file=self.dashboard_cert,
            key_file=self.dashboard_key,
        )
