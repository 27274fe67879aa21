"""The sections of the coordinator's settings, one per feature: `[dp]`, `[secagg]`, `[async]`, ...

Each field is declared once, here: its type, default, bounds and help make the flag (see
`protocols.settings_options`), the TOML key and the `PFL_*` variable. Each section also builds
the typed settings its stage takes, so the programs hand the stages no loose fields.
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
from protocols.messages import Compression
from protocols.privacy import Distribution, Mechanism, Placement, PrivacySettings, Sampling
from protocols.secure_aggregation import SecureAggregationSettings
from protocols.settings_sections import Section, flat_name


def model_help() -> str:
    """`--model`'s help: each built-in task that offers a choice of model, with its models."""
    from pfl_tasks.registry import BUILTIN_TASKS  # the tasks import torch: only when asked

    declared = {name: getattr(task, "models", ()) for name, task in BUILTIN_TASKS.items()}
    offers = [f"{name}: {', '.join(models)}" for name, models in declared.items() if models]
    return (
        "the task's model, one it offers (" + "; ".join(offers) + "); default: the task's "
        "own; refused for a task with a fixed model"
    )


class DpOptions(Section):
    """Differential privacy: `--dp-*` flags, `[dp]` table."""

    table = "dp"
    flag_prefix = "dp_"
    panel = "Differential privacy (dp)"

    noise: float | None = Field(
        default=None,
        ge=0,
        description="differential privacy: noise multiplier z; each shared delta is clipped and "
        "N(0, (z*clip)^2) is added to their sum (default: no DP)",
    )
    clip: float = Field(default=1.0, gt=0, description="DP: L2 clip norm of each shared delta")
    placement: Placement = Field(
        default="coordinator",
        description="DP: who adds the noise, coordinator or device (device needs --secagg)",
    )
    distribution: Distribution = Field(
        default="gaussian",
        description="DP: gaussian, or discrete-gaussian added by devices inside secure "
        "aggregation's integer ring (needs --dp-placement device)",
    )
    sampling: Sampling | None = Field(
        default=None,
        description="DP: poisson (each device joins with probability --participation) or fixed "
        "(default: poisson; ftrl-tree takes the cohort as the strategy selects it, and "
        "--mode async samples nobody: fixed)",
    )
    mechanism: Mechanism = Field(
        default="dp-fedavg",
        description="DP: dp-fedavg (fresh noise on each round's sum, amplified by --dp-sampling) "
        "or ftrl-tree (DP-FTRL's tree aggregation, no sampling needed; [dp_options] "
        "tree_restart, tree_participations)",
    )
    delta: float = Field(
        default=1e-5, gt=0, lt=1, description="DP: the delta epsilon is reported at"
    )
    epsilon: float | None = Field(
        default=None, gt=0, description="DP: epsilon budget; the run stops before passing it"
    )
    on_budget: Literal["stop", "warn"] = Field(
        default="stop", description="DP: stop or warn at the budget"
    )
    adaptive_clip: bool = Field(
        default=False, description="DP: move the clip norm to the median update norm"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="[dp_options] (or [dp.options]): target_quantile, clip_learning_rate, "
        "tree_restart, tree_participations",
    )

    def privacy_settings(self, *, asynchronous: bool = False) -> PrivacySettings | None:
        """The run's differential privacy (None without a noise multiplier).

        Sampling defaults to poisson for dp-fedavg's synchronous rounds, else to fixed: an
        asynchronous aggregation draws no sample (`PrivacyEngine.plan_aggregation`).

        Raises:
            ValueError: invalid DP options.
        """
        if self.noise is None:
            return None
        return PrivacySettings(
            noise_multiplier=self.noise,
            clip_norm=self.clip,
            placement=self.placement,
            distribution=self.distribution,
            sampling=self.sampling
            or ("poisson" if self.mechanism == "dp-fedavg" and not asynchronous else "fixed"),
            mechanism=self.mechanism,
            delta=self.delta,
            target_epsilon=self.epsilon,
            on_budget=self.on_budget,
            adaptive_clipping=self.adaptive_clip,
            **self.options,
        )


class SecaggOptions(Section):
    """Secure aggregation: `--secagg` and `--secagg-*` flags, `[secagg]` table."""

    table = "secagg"
    flag_prefix = "secagg_"
    panel = "Secure aggregation (secagg)"

    enabled: bool = Field(
        default=False,
        description="secure aggregation: devices mask their updates so the coordinator learns "
        "only their sum",
        json_schema_extra=flat_name("secagg"),
    )
    neighbors: int = Field(
        default=0,
        ge=0,
        description="secagg: devices each masks with (0: every other selected device; k: "
        "SecAgg+ with k, for large cohorts)",
    )
    threshold: float = Field(
        default=0.6,
        gt=0.5,
        le=1,
        description="secagg: share of a device's neighbours needed to unmask",
    )
    clip: float = Field(
        default=10.0, gt=0, description="secagg: L2 clip norm of each shared delta without DP"
    )

    def secure_aggregation(
        self, max_weight_share: float, *, int8: bool = False
    ) -> SecureAggregationSettings | None:
        """The run's secure aggregation (None unless enabled); `int8`: updates as int8 levels."""
        if not self.enabled:
            return None
        return SecureAggregationSettings(
            threshold=self.threshold,
            neighbors=self.neighbors,
            clip_norm=self.clip,
            max_weight_share=max_weight_share,
            int8=int8,
        )


class AsyncOptions(Section):
    """Buffered asynchronous aggregation (with `--mode async`): `[async]` table."""

    table = "async"
    panel = "Asynchronous aggregation (async)"

    buffer: int = Field(default=10, ge=1, description="async: updates per aggregation, FedBuff's K")
    max_staleness: int = Field(
        default=10, ge=0, description="async: drop updates more aggregations behind than this"
    )
    staleness: str = Field(
        default="poly:0.5", description="async: staleness weight: constant, poly[:a], hinge[:a[:b]]"
    )
    concurrency: int = Field(
        default=0, ge=0, description="async: devices training at once, 0 = participation x fleet"
    )
    fair_share: float = Field(
        default=2.0,
        ge=0,
        description="async: a device above this x its fair share of the recent buffers is "
        "asked later, and above its fair share weighed down; 0 = off",
    )
    fair_share_window: int = Field(
        default=20, ge=1, description="async: aggregations the fair share is counted over"
    )

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

    def async_settings(self) -> AsyncSettings:
        """These settings as the buffered rounds take them."""
        return AsyncSettings(
            buffer=self.buffer,
            max_staleness=self.max_staleness,
            staleness=StalenessRule.parse(self.staleness),
            concurrency=self.concurrency,
            fair_share=self.fair_share,
            fair_share_window=self.fair_share_window,
        )


class GuardOptions(Section):
    """The bounds on one device's influence on a round: `[guard]` table."""

    table = "guard"
    panel = "Aggregation guard (guard)"

    max_count_ratio: float = Field(
        default=3.0,
        ge=0,
        description="count no device above this x the round's lower median count, 0 = off",
    )
    count_spread_power: float = Field(
        default=4.0,
        ge=0,
        description="where counts spread out, that multiple widens to (Q3/Q1)^this",
    )
    max_weight_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="no device weighs more than this share of a round, 1 = off",
    )
    norm_bound: float = Field(
        default=4.0,
        ge=0,
        description="clip updates to this x the round's lower median norm, 0 = off",
    )
    max_samples: int = Field(
        default=100_000_000, ge=1, description="most training samples a device may declare"
    )
    quarantine_after: int = Field(
        default=64,
        ge=0,
        description="messages of a device dropped in a round before it sits out the rest, 0 = off",
    )

    def guard_settings(self, private: bool, comparable: bool) -> GuardSettings:
        """The guard's settings; `private` runs (DP, secagg) and incomparable norms cut less.

        Under DP every update is clipped and weighs the same, and the screen's norm cut (which
        depends on the other devices' norms) would break the accountant's sensitivity bound; an
        algorithm whose updates move different models has no norm cut either.
        """
        return GuardSettings(
            max_samples=self.max_samples,
            max_count_ratio=0.0 if private else self.max_count_ratio,
            count_spread_power=self.count_spread_power,
            max_weight_share=1.0 if private else self.max_weight_share,
            norm_bound=self.norm_bound if comparable and not private else 0.0,
            quarantine_after=self.quarantine_after,
        )


class CompressOptions(Section):
    """How updates and models travel: `--compress`, `--compress-down`, `[compress]` table."""

    table = "compress"
    flag_prefix = "compress_"
    panel = "Compression (compress)"

    up: str = Field(
        default="none",
        description="how devices send updates: none, int8, int8:stochastic or topk:<fraction> "
        "such as topk:0.01, with error feedback",
        json_schema_extra=flat_name("compress"),
    )
    down: Literal["none", "int8"] = Field(
        default="none",
        description="none, or int8: a device holding the previous model downloads an int8 delta",
    )

    @field_validator("up")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        return str(Compression.parse(value))

    def uplink(self) -> Compression:
        """The codec devices encode their updates with (`protocols.compression`)."""
        return Compression.parse(self.up)


class SimOptions(Section):
    """The simulated clock of `pfl-coord simulate`: `--sim-*` flags, `[sim]` table."""

    table = "sim"
    flag_prefix = "sim_"
    panel = "Simulated clock (sim)"

    speeds: str = Field(
        default="equal",
        description="device speeds: equal, or lognormal:<ratio of the 95th to the 5th percentile>",
    )
    availability: str = Field(
        default="always",
        description="when devices are online: always, diurnal[:on_fraction[:period_s]] or "
        "trace:<sessions.csv>",
    )
    uptime: float = Field(
        default=0.0,
        ge=0,
        description="mean simulated seconds online between random dropouts, 0 = none",
    )
    downtime: float = Field(
        default=300.0, ge=0, description="simulated seconds offline after a dropout"
    )
    seconds_per_sample: float = Field(
        default=0.01, gt=0, description="simulated seconds per sample and epoch at speed 1"
    )
    latency: float = Field(
        default=1.0, ge=0, description="simulated seconds per job beyond training"
    )
    deadline: float = Field(
        default=0.0, ge=0, description="sync: a round's deadline in simulated seconds, 0 = none"
    )

    @field_validator("speeds")
    @classmethod
    def _known_speeds(cls, value: str) -> str:
        parse_speeds(value)
        return value

    def clock(self, device_ids: list[str], seed: int, fastest: frozenset[str]) -> SimulatedClock:
        """The clock these settings describe.

        Raises:
            ValueError: an availability that does not parse (FileNotFoundError: no trace file).
        """
        return SimulatedClock(
            device_ids,
            seed,
            speed_ratio=parse_speeds(self.speeds),
            availability=AvailabilitySpec.parse(self.availability, self.uptime, self.downtime),
            timing=DeviceTiming(self.seconds_per_sample, self.latency),
            deadline_s=self.deadline,
            fastest=fastest,
        )


class DashboardOptions(Section):
    """`pfl-coord serve`'s live web dashboard: `--dashboard*` flags, `[dashboard]` table."""

    table = "dashboard"
    flag_prefix = "dashboard_"
    panel = "Dashboard (dashboard)"

    listen: str | None = Field(
        default=None,
        description="HOST:PORT to serve the live web dashboard on, e.g. 127.0.0.1:8080",
        json_schema_extra=flat_name("dashboard"),
    )
    token: str | None = Field(
        default=None,
        description="token browsers must present (default: made up for this run and printed)",
    )
    token_file: Path | None = Field(
        default=None, description="also write the dashboard's token to this file (mode 0600)"
    )
    open_to_local_users: bool = Field(
        default=False,
        description="no dashboard token (loopback only): every user of this machine reads the "
        "fleet",
    )
    cert: Path | None = Field(
        default=None, description="TLS certificate (PEM) for the dashboard, e.g. provisioned"
    )
    key: Path | None = Field(default=None, description="private key (PEM) of --dashboard-cert")

    def dashboard_settings(self) -> DashboardSettings | None:
        """How to serve the dashboard, or None without a listen address."""
        if self.listen is None:
            return None
        return DashboardSettings(
            listen=self.listen,
            token=self.token,
            token_file=self.token_file,
            open_to_local_users=self.open_to_local_users,
            cert_file=self.cert,
            key_file=self.key,
        )
