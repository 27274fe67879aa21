"""What each feature of a run needs of the algorithm and of the other features, and why.

A feature states its requirements as functions of the algorithm's declared capabilities
(`protocols.capabilities`, `AlgorithmConfig` methods) and as reasons keyed by the other
features it needs, refuses or resolves; `coordinator.stages.compatibility` checks a run
against them and writes docs/compatibility.md from them. Resolutions are documented changes a
feature makes to another (no flag is changed silently: an explicit conflicting flag is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from protocols.algorithms import AlgorithmConfig, NormStats
from protocols.capabilities import SHARING, AggregationKind
from protocols.messages import Compression
from protocols.privacy import PrivacySettings
from protocols.secure_levels import ROUNDED_GAUSSIAN, TOPK_MASKED


@dataclass(frozen=True)
class Choices:
    """What a run turns on, as the features read it (`compatibility.choices_of`)."""

    privacy: PrivacySettings | None
    secure: bool
    asynchronous: bool
    uplink: Compression
    downlink: str
    pretrain_rounds: int
    participation: float
    guard_flags: frozenset[str]
    """The guard's flags set to something other than their default and other than off."""
    stateless: bool = False
    tier: bool = False
    """Partial aggregates from an aggregator tier (--tier-aggregators)."""
    simulated_clock: bool = False
    """Synchronous rounds on the simulated clock (--sim-* settings)."""
    simulation: bool = False
    """A simulation: the coordinator, aggregators and devices share one in-process hub."""
    norm_stats: NormStats | None = None
    """Where the model's normalization statistics go (--norm-stats; None: it has none)."""


Refusal = Callable[[AlgorithmConfig, Choices], str | None]


def _accepts(config: AlgorithmConfig, choices: Choices) -> str | None:
    del config, choices
    return None


@dataclass(frozen=True)
class Feature:
    """One feature: how a run turns it on, and what it needs of the algorithm and the others."""

    key: str
    """Its name in docs/compatibility.md and in `needs`/`conflicts`/`resolutions` of others."""
    title: str
    """What its refusals start with ("differential privacy: ...")."""
    example: Mapping[str, object]
    """Settings that turn it on in a simulation (the compatibility tests run them)."""
    on: Callable[[Choices], bool]
    refuses: Refusal = _accepts
    """Why it cannot run with this algorithm's config (None: it can)."""
    needs: Mapping[str, str] = field(default_factory=dict)
    """Features it cannot run without, and why."""
    conflicts: Mapping[str, str] = field(default_factory=dict)
    """Features it cannot run with, and why."""
    resolutions: Mapping[str, str] = field(default_factory=dict)
    """Features that change what it does when both run, and how (documented, not refused)."""
    note: Callable[[AlgorithmConfig], str | None] = lambda config: None
    """What it does differently with this algorithm (documented, not refused)."""


@dataclass(frozen=True)
class _SumStage:
    """The refusals of a stage that works on the sum of the updates (DP, secure aggregation)."""

    no_sum: Mapping[AggregationKind, str]
    """Why there is nothing for it to work on, per kind of aggregation that is not a mean."""
    scalars: str
    """What it cannot do with per-device scalars read in clear."""
    clips: str
    """What it says to a config that clips each update on the coordinator."""

    def __call__(self, config: AlgorithmConfig, choices: Choices) -> str | None:
        del choices
        kind = config.capabilities.aggregation
        if kind != "mean":
            return f"{config.name} {SHARING[kind]}: {self.no_sum[kind]}"
        each, scalars = config.needs_each_update(), config.capabilities.clear_scalars
        clips = config.clips_each_update()
        if each is not None:
            return f"{config.name}: {each}"
        if scalars is not None:
            return f"{config.name}: {scalars}: {self.scalars}"
        return None if clips is None else f"{config.name}: {clips}{self.clips}"


_dp_refuses: Final = _SumStage(
    {
        "relay": "there is no sum to clip and noise, and every model leaves its device whole",
        "none": "there is nothing to protect",
    },
    scalars="functions of each device's data the accountant does not cover",
    clips="; DP's --dp-clip replaces clip_update_norm: leave it unset",
)
_secure_refuses: Final = _SumStage(
    {
        "relay": "there is no sum for masks to hide a device in",
        "none": "there is nothing to aggregate",
    },
    scalars="that needs each device's scalars in clear",
    clips=", which sees only their sum under secure aggregation; each device clips to "
    "--secagg-clip instead: leave clip_update_norm unset",
)

_tier_sums: Final = _SumStage(
    {
        "relay": "there is no sum for an aggregator to form, and every model leaves its "
        "device whole",
        "none": "there is nothing to aggregate",
    },
    scalars="that needs each device's scalars in clear, and an aggregator sends only sums",
    clips=", which sees only partial aggregates with the tier; each aggregator clips every "
    "update to --tier-clip instead: leave clip_update_norm unset",
)
_TIER_SECURE_SIMULATED: Final = (
    "does not combine with secure aggregation (--secagg) in a simulation: each aggregator runs "
    "the protocol's phases for its group on a thread of its own, waiting for its devices, and a "
    "simulation's aggregators share the coordinator's thread on the in-process hub; serve the "
    "run (`pfl-coord serve`) with `pfl-coord aggregator` processes"
)
_TIER_DEVICE_NOISE: Final = (
    "does not combine with --dp-placement device: each group's sum would carry only its "
    "devices' shares of the noise, and its aggregator sees that sum; use --dp-placement "
    "coordinator (noise added once, to the combined sum)"
)


def _tier_refuses(config: AlgorithmConfig, choices: Choices) -> str | None:
    """Secure aggregation within groups runs only in aggregator processes, with central noise."""
    if choices.secure and choices.simulation:
        return _TIER_SECURE_SIMULATED
    if choices.privacy is not None and choices.privacy.placement == "device":
        return _TIER_DEVICE_NOISE
    return _tier_sums(config, choices)


def _async_refuses(config: AlgorithmConfig, choices: Choices) -> str | None:
    reason = config.capabilities.synchronous
    if reason is not None:
        return f"{config.name} needs synchronous rounds: {reason}; use --mode sync"
    dp = choices.privacy
    if dp is not None and dp.sampling == "poisson":
        return ASYNC_POISSON
    if dp is not None and dp.tree_participations is not None:
        return ASYNC_TREE_LIMIT
    return None


def _uplink_refuses(config: AlgorithmConfig, choices: Choices) -> str | None:
    return config.compression_problem(choices.uplink, "none")


def _downlink_refuses(config: AlgorithmConfig, choices: Choices) -> str | None:
    return config.compression_problem(Compression(), choices.downlink)


def _stateless_refuses(config: AlgorithmConfig, choices: Choices) -> str | None:
    del choices
    if not config.stateful_only:
        return None
    return f"{config.name} keeps per-device state between rounds: run it without --stateless"


def _norms_refuse(config: AlgorithmConfig, choices: Choices) -> str | None:
    del choices
    if config.comparable_update_norms:
        return None
    return (
        f"{config.name}'s updates move different models, so one update's norm says nothing of "
        "the others' and the guard's norm screen is off for it: leave --norm-bound unset"
    )


def _norms_note(config: AlgorithmConfig) -> str | None:
    if config.comparable_update_norms:
        return None
    return "the norm screen is off: each update moves different models, by incomparable norms"


def _norm_stats_refuse(config: AlgorithmConfig, choices: Choices) -> str | None:
    kind = config.capabilities.aggregation
    if kind == "relay":
        return (
            f"{config.name} {SHARING[kind]}, moved by their owners' gradients: running "
            "statistics are no gradient, so a relayed model's would keep their initial values; "
            "use a model without BatchNorm (GroupNorm or LayerNorm need no statistics)"
        )
    if kind == "none" and choices.norm_stats == "shared":
        return f"{config.name} {SHARING[kind]}: there is no mean to share statistics in; leave "
        "--norm-stats personal"
    return None


DP: Final = "DP"
SECAGG: Final = "secagg"
UPLINK_INT8: Final = "int8 uplink"
UPLINK_TOPK: Final = "top-k uplink"
DOWNLINK_INT8: Final = "int8 downlink"
PRETRAIN: Final = "pretraining"
NORM_STATS: Final = "BatchNorm"
BATCH_NORM_TASK: Final = "tests.normalization.bn_models:task"
"""A small CNN with BatchNorm on the digits: the model the compatibility tests run it with."""
TIER: Final = "aggregator tier"
DEVICE_NOISE_ALONE: Final = (
    "--dp-placement device needs --secagg: each device adds only its 1/sqrt(m) share of the "
    "noise, so without secure aggregation the coordinator sees every update with that share "
    "alone, and nothing clips an update after its device"
)
ASYNC_POISSON: Final = (
    "does not combine with --dp-sampling poisson: an aggregation's devices are those whose "
    "updates arrive first, not a secret Poisson sample the accountant could amplify by; leave "
    "--dp-sampling unset (fixed: each aggregation accounted without amplification)"
)
ASYNC_TREE_LIMIT: Final = (
    "does not combine with DP-FTRL's tree_participations: the asynchronous scheduler does not "
    "enforce a per-tree limit (a device joins at most once per aggregation, which the tree's "
    "accountant counts with tree_participations unset)"
)
_EQUAL_UNDER_DP: Final = "DP clips every update to --dp-clip and weighs each the same"
_ONLY_THE_SUM: Final = "the coordinator sees only the sum of the updates"
_ONLY_THE_GROUPS: Final = "the coordinator sees only each aggregator's sum of its group's updates"


def _uplink(key: str, example: str) -> Feature:
    """Updates sent with `example`'s codec (any of its options)."""
    codec = Compression.parse(example).codec
    return Feature(
        key,
        "--compress",
        {"compress": example},
        lambda run: run.uplink.codec == codec,
        refuses=_uplink_refuses,
    )


def _dp(
    key: str,
    options: Mapping[str, object],
    on: Callable[[PrivacySettings], bool],
    *,
    refuses: Refusal = _accepts,
    needs: Mapping[str, str] | None = None,
    conflicts: Mapping[str, str] | None = None,
) -> Feature:
    """Differential privacy (--dp-noise 1) with `options`, on where `on` holds of its settings."""
    return Feature(
        key,
        "differential privacy",
        {"dp_noise": 1.0, **options},
        lambda run: run.privacy is not None and on(run.privacy),
        refuses=refuses,
        needs=needs or {},
        conflicts=conflicts or {},
    )


FEATURES: Final[tuple[Feature, ...]] = (
    _uplink(UPLINK_INT8, "int8"),
    _uplink(UPLINK_TOPK, "topk:0.25"),
    Feature(
        DOWNLINK_INT8,
        "--compress-down",
        {"compress_down": "int8"},
        lambda run: run.downlink != "none",
        refuses=_downlink_refuses,
    ),
    _dp(
        "DP on devices",
        {"dp_placement": "device"},
        lambda dp: dp.placement == "device" and dp.distribution == "gaussian",
        needs={SECAGG: DEVICE_NOISE_ALONE},
        conflicts={UPLINK_INT8: ROUNDED_GAUSSIAN},
    ),
    _dp(
        "discrete Gaussian",
        {"dp_placement": "device", "dp_distribution": "discrete-gaussian"},
        lambda dp: dp.distribution == "discrete-gaussian",
        needs={SECAGG: DEVICE_NOISE_ALONE},
    ),
    _dp(DP, {}, lambda dp: True, refuses=_dp_refuses),
    _dp("DP-FTRL", {"dp_mechanism": "ftrl-tree"}, lambda dp: dp.mechanism == "ftrl-tree"),
    # the count's noise grows with the cohort: a cohort of 2 (an async buffer) needs 0.3
    _dp(
        "adaptive clip",
        {"dp_adaptive_clip": True, "dp_options": {"quantile_noise": 0.3}},
        lambda dp: dp.adaptive_clipping,
    ),
    Feature(
        SECAGG,
        "secure aggregation",
        {"secagg": True},
        lambda run: run.secure,
        refuses=_secure_refuses,
        conflicts={UPLINK_TOPK: TOPK_MASKED},
    ),
    Feature(
        TIER,
        "the aggregator tier",
        {"tier_aggregators": "site-a,site-b"},
        lambda run: run.tier,
        refuses=_tier_refuses,
        conflicts={
            "async": "does not combine with --mode async: an aggregator sums one round's "
            "cohort, and a buffer mixes devices asked at different times",
            "simulated clock": "does not combine with --sim-*: rounds on the simulated clock "
            "collect each update at its simulated arrival, not through the aggregators",
            "--norm-bound": f"{_ONLY_THE_GROUPS}, so there is no update norm to screen (each "
            "aggregator clips to --tier-clip): leave --norm-bound unset",
            "--max-count-ratio": f"{_ONLY_THE_GROUPS}, so there are no counts to cap: leave "
            "--max-count-ratio unset",
            "--max-weight-share": f"{_ONLY_THE_GROUPS}, so there is no device weight to cap: "
            "leave --max-weight-share unset",
        },
    ),
    Feature(
        "async",
        "--mode async",
        {"mode": "async", "buffer": 2},
        lambda run: run.asynchronous,
        refuses=_async_refuses,
        conflicts={
            SECAGG: "does not combine with secure aggregation (--secagg): masks cancel only "
            "within one round's cohort, and a buffer mixes devices asked at different times",
            PRETRAIN: "does not combine with --pretrain-rounds: the shared part changes between "
            "stages, and updates in flight would straddle it",
            DOWNLINK_INT8: "does not combine with --compress-down int8: devices fetch whichever "
            "model is current when they start, and a model delta needs the one just before it; "
            "use --compress-down none",
        },
        resolutions={
            DP: "each aggregation is a release: the noised sum of its buffer's clipped updates "
            "(devices clip as told in each announcement, the coordinator again after the "
            "staleness and fair-share weights, each at most 1), divided by --buffer and "
            "accounted as a Gaussian mechanism with no sampling amplification; --dp-sampling "
            "defaults to fixed (replace-one, sensitivity 2C), and poisson is refused",
        },
    ),
    Feature(
        "simulated clock",
        "--sim-*",
        {"sim_speeds": "lognormal:4"},
        lambda run: run.simulated_clock,
    ),
    Feature(
        "stateless",
        "--stateless",
        {"stateless": True},
        lambda run: run.stateless,
        refuses=_stateless_refuses,
    ),
    Feature(
        NORM_STATS,
        "a model with BatchNorm",
        {"task": BATCH_NORM_TASK},
        lambda run: run.norm_stats is not None,
        refuses=_norm_stats_refuse,
    ),
    Feature(
        PRETRAIN, "--pretrain-rounds", {"pretrain_rounds": 1}, lambda run: run.pretrain_rounds > 0
    ),
    Feature(
        "participation < 1",
        "--participation",
        {"participation": 0.75},
        lambda run: run.participation < 1,
        resolutions={
            DP: "--participation is the cohort's rate: with Poisson sampling (DP-FedAvg's "
            "default) each device's inclusion probability, the engine drawing the cohort and the "
            "strategy taking all of it; with fixed sampling the strategy's fixed share"
        },
    ),
    Feature(
        "guard",
        "the guard",
        {},
        lambda run: True,
        resolutions={
            DP: f"the count caps and the norm screen are off: {_EQUAL_UNDER_DP}",
            SECAGG: f"the count-ratio cap and the norm screen are off: {_ONLY_THE_SUM}, each "
            "clipped to --secagg-clip on its device, and --max-weight-share caps the counts",
        },
        note=_norms_note,
    ),
    Feature(
        "--norm-bound",
        "--norm-bound",
        {"norm_bound": 2.0},
        lambda run: "norm_bound" in run.guard_flags,
        refuses=_norms_refuse,
        conflicts={
            DP: f"{_EQUAL_UNDER_DP}, and a cut that depends on the other devices' norms would "
            "break the accountant's sensitivity bound: leave --norm-bound unset",
            SECAGG: f"{_ONLY_THE_SUM}, so there is no update norm to screen (each device clips "
            "to --secagg-clip): leave --norm-bound unset",
        },
    ),
    Feature(
        "--max-count-ratio",
        "--max-count-ratio",
        {"max_count_ratio": 2.0},
        lambda run: "max_count_ratio" in run.guard_flags,
        conflicts={
            DP: f"{_EQUAL_UNDER_DP}: there are no counts to cap; leave --max-count-ratio unset",
            SECAGG: "the secure round's weight bound caps the declared counts by "
            "--max-weight-share, not by their ratio: leave --max-count-ratio unset",
        },
    ),
    Feature(
        "--max-weight-share",
        "--max-weight-share",
        {"max_weight_share": 0.4},
        lambda run: "max_weight_share" in run.guard_flags,
        conflicts={DP: f"{_EQUAL_UNDER_DP}: leave --max-weight-share unset"},
    ),
)
"""Every feature, in the order a run is checked (the first problem found is reported)."""
