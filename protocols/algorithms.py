"""Typed configuration of every algorithm, selected by name through one registry.

A config travels inside each RoundAnnouncement, so a device always trains with exactly the
hyperparameters the coordinator chose for that round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Final, Literal

from pydantic import Field, ValidationError, model_validator

from protocols.algorithm_config import AggregationWeights as AggregationWeights
from protocols.algorithm_config import AlgorithmConfig as AlgorithmConfig
from protocols.algorithm_config import Beta, PersonalDefault, PositiveFloat
from protocols.algorithm_config import NormStats as NormStats
from protocols.algorithm_config import PersonalPreset as PersonalPreset
from protocols.algorithm_config import RobustAggregation as RobustAggregation
from protocols.algorithm_config import ServerOptimizerName as ServerOptimizerName
from protocols.capabilities import WEIGHTED_MEAN, Capabilities
from protocols.messages import Compression


class LocalConfig(AlgorithmConfig):
    """Each device trains alone; nothing is shared (the no-federation baseline)."""

    name: ClassVar[str] = "local"
    capabilities: ClassVar[Capabilities] = Capabilities(
        aggregation="none",
        clear_scalars=None,
        synchronous="local training aggregates nothing, so it has no rounds to make asynchronous",
    )
    default_personal: ClassVar[PersonalDefault] = "all"
    stateful_only: ClassVar[bool] = True


class FedAvgConfig(AlgorithmConfig):
    """FedAvg and its adaptive variants (Reddi et al. 2021): mean shared delta, then a server step.

    `server_optimizer` "fedavg" is server SGD, u + server_lr * mean delta; "fedadam" is Adam on
    the pseudo-gradient -mean delta with bias correction (spec §1.5, §7.3). Deltas are weighted
    by the devices' sample counts or uniformly (spec §7.2), renormalized over the reporters.
    Against poisoned updates, `clip_update_norm` scales each delta to at most that L2 norm and
    `robust_aggregation` "median" or "trimmed-mean" (dropping `trim_fraction` of the values at
    each end, per coordinate) or "centered-clipping" (Karimireddy et al. 2021: `cc_iterations`
    steps of clipped differences to radius `cc_tau` around the previous round's aggregate; None:
    the lower median distance) replaces the weighted mean (coordinator/strategies/aggregate.py).
    """

    name: ClassVar[str] = "fedavg"
    capabilities: ClassVar[Capabilities] = WEIGHTED_MEAN
    server_lr: PositiveFloat = 1.0
    server_optimizer: ServerOptimizerName = "fedavg"
    adam_beta1: Beta = 0.9
    adam_beta2: Beta = 0.999
    adam_eps: PositiveFloat = 1e-8
    aggregation_weights: AggregationWeights = "samples"
    robust_aggregation: RobustAggregation = "mean"
    trim_fraction: Annotated[float, Field(ge=0, le=0.5)] = 0.1
    clip_update_norm: PositiveFloat | None = None
    cc_tau: PositiveFloat | None = None
    cc_iterations: Annotated[int, Field(ge=1, le=100)] = 1

    def weighs_equally(self) -> bool:
        """`aggregation_weights` "uniform"."""
        return self.aggregation_weights == "uniform"

    def needs_each_update(self) -> str | None:
        """A robust aggregation is an order statistic or an iteration over the updates."""
        if self.robust_aggregation == "mean":
            return None
        return (
            f"robust_aggregation {self.robust_aggregation!r} is not a sum: it needs each update "
            "in clear, and clipping already bounds each device: use mean"
        )

    def clips_each_update(self) -> str | None:
        """`clip_update_norm`, when set."""
        if self.clip_update_norm is None:
            return None
        return f"clip_update_norm {self.clip_update_norm:g} clips each update on the coordinator"


class FedAvgFtConfig(FedAvgConfig):
    """FedAvg, then each device fine-tunes the final model on its own data before use."""

    name: ClassVar[str] = "fedavg-ft"
    capabilities: ClassVar[Capabilities] = WEIGHTED_MEAN
    finetune_epochs: Annotated[int, Field(ge=0)] = 3
    finetune_lr: PositiveFloat = 0.02
    finetune_select: bool = True
    """Keep the fine-tuned model only where it scores at least as well as the global model on
    the device's validation split (per device); False: every device fine-tunes."""


class FedProxConfig(FedAvgConfig):
    """FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in the local loss."""

    name: ClassVar[str] = "fedprox"
    capabilities: ClassVar[Capabilities] = WEIGHTED_MEAN
    mu: Annotated[float, Field(ge=0)] = 0.01


class PartialConfig(FedAvgConfig):
    """What FedAlt and FedSim share: the task's personal part by default, and stage c.

    Shared steps use `lr`, `local_epochs` and `max_steps`; personal steps use `personal_lr`
    (None = `lr`), spec §5.4 rule 1 / §7.1. After training, `personalize` fine-tunes only the
    personal part for `finetune_epochs` at `finetune_lr` (None = the personal lr), spec §3.1(c).
    """

    default_personal: ClassVar[PersonalDefault] = "task"
    personal_lr: PositiveFloat | None = None
    finetune_epochs: Annotated[int, Field(ge=0)] = 5
    finetune_lr: PositiveFloat | None = None

    def personal_step_size(self) -> float:
        """gamma_v: `personal_lr`, falling back to `lr`."""
        return self.personal_lr if self.personal_lr is not None else self.lr

    def finetune_step_size(self) -> float:
        """Stage c's step size: `finetune_lr`, falling back to gamma_v."""
        return self.finetune_lr if self.finetune_lr is not None else self.personal_step_size()


class FedAltConfig(PartialConfig):
    """FedAlt (spec §1.3): tau_v personal steps with shared frozen, then tau_u shared steps.

    tau_v is `personal_epochs` passes (None = `local_epochs`, as the paper's one epoch each; 0
    skips the personal phase), capped at `personal_max_steps`; tau_u is `local_epochs`, capped
    at `max_steps`.
    """

    name: ClassVar[str] = "fedalt"
    capabilities: ClassVar[Capabilities] = WEIGHTED_MEAN
    personal_epochs: Annotated[int, Field(ge=0)] | None = None
    personal_max_steps: Annotated[int, Field(ge=1)] | None = None


class FedSimConfig(PartialConfig):
    """FedSim (spec §1.4): tau steps (`local_epochs`/`max_steps`) move u and v together."""

    name: ClassVar[str] = "fedsim"
    capabilities: ClassVar[Capabilities] = WEIGHTED_MEAN


PriorRule = Literal["identity", "lg", "meg", "mh", "mh_simple"]
ProxInit = Literal["local", "mu", "prev_theta"]


class ProximalPriorConfig(AlgorithmConfig):
    """What pFedMe and pFedBreD share (pfedbred spec §2.2, §3 table; paper defaults).

    R = `local_steps` minibatch iterations (not epochs, §6 A10), each solving the personal
    problem f(theta) + lam/2 ||theta - mu||^2 approximately by K = `prox_steps` steps at
    alpha_p = `personal_lr` on one batch, then moving w by `lr` (alpha_m) along lam (mu - theta).
    The coordinator mixes with `beta` (aggregate momentum, §2.3); `train_all_clients` trains
    every online device and aggregates only the sampled ones, as the official code (§6 A6).
    `prox_init` None warm-starts the prox solve as the code does (§6 A3). `finetune_steps` is the
    "+FT" trick applied to theta before evaluation and export (§6 A11), off by default.
    """

    default_personal: ClassVar[PersonalDefault] = "none"
    batch_size: Annotated[int, Field(ge=1)] = 20
    lr: PositiveFloat = 0.01
    local_steps: Annotated[int, Field(ge=1)] = 20
    prox_steps: Annotated[int, Field(ge=1)] = 5
    personal_lr: PositiveFloat = 0.01
    lam: PositiveFloat = 15.0
    beta: PositiveFloat = 1.0
    train_all_clients: bool = False
    prox_init: ProxInit | None = None
    finetune_steps: Annotated[int, Field(ge=0)] = 0

    def prior_rule(self) -> PriorRule:
        """How the prior mean mu is built from w (spec §1.5); pFedMe's is the identity."""
        return "identity"

    def needs_each_update(self) -> str | None:
        """`train_all_clients` aggregates only the sampled ones of the devices that trained."""
        if not self.train_all_clients:
            return None
        return (
            "train_all_clients trains devices outside the sampled cohort and aggregates a "
            "subset of those that trained, which needs their updates one by one: set it to false"
        )


GLOBAL_STEP: Final = Capabilities(
    aggregation="mean",
    clear_scalars=None,
    synchronous="its global step mixes one round's personalized models with the previous "
    "global model (beta-weighted), a synchronous step with no asynchronous form",
)
"""pFedMe's and pFedBreD's: a mean of deltas, mixed into w by a synchronous momentum step."""


class PFedMeConfig(ProximalPriorConfig):
    """pFedMe (spec §5): pFedBreD with the identity prior mean mu = w ("Non-PP").

    Its step sizes and R are not the paper's (alpha_m = alpha_p = 0.01, R = 20, still pFedBreD's):
    with those it trails local training on its own digits benchmark (0.880 against 0.895, seeds
    0-1), with these it leads (0.947) in half the time.
    """

    name: ClassVar[str] = "pfedme"
    capabilities: ClassVar[Capabilities] = GLOBAL_STEP
    lr: PositiveFloat = 0.05
    local_steps: Annotated[int, Field(ge=1)] = 10
    personal_lr: PositiveFloat = 0.1


class PFedBreDConfig(ProximalPriorConfig):
    """pFedBreD (spec §1.5, §2.2): a personalized prior mean mu_i(w) before each prox solve.

    `prior` picks the strategy: "lg" (loss gradient, eta_alpha), "meg" (memorized envelope
    gradient, eta), "mh" (both; the code's Eq. 22 nested-gradient form, §6 A2), "mh_simple"
    (Eq. 14's single gradient) or "identity" (pFedMe). `meta_step_updates_w` moves w itself by
    the mh look-ahead as the official code does (§6 A1); the paper-literal mh is
    prior="mh_simple" with meta_step_updates_w=False.
    """

    name: ClassVar[str] = "pfedbred"
    capabilities: ClassVar[Capabilities] = GLOBAL_STEP
    prior: PriorRule = "mh"
    eta: Annotated[float, Field(ge=0)] = 0.05
    eta_alpha: Annotated[float, Field(ge=0)] = 0.01
    meta_step_updates_w: bool = True

    def prior_rule(self) -> PriorRule:
        """The configured prior strategy."""
        return self.prior


class DittoConfig(FedAvgConfig):
    """Ditto (spec §5): FedAvg's global model plus a personal theta pulled toward it by `lam`.

    theta takes `personal_epochs` passes (None = `local_epochs`) at `personal_lr` (None = `lr`)
    on f(theta) + lam/2 ||theta - w_global||^2 each round; FedAvg's local SGD trains w.
    """

    name: ClassVar[str] = "ditto"
    capabilities: ClassVar[Capabilities] = WEIGHTED_MEAN
    lam: Annotated[float, Field(ge=0)] = 1.0
    personal_epochs: Annotated[int, Field(ge=1)] | None = None
    personal_lr: PositiveFloat | None = None


StepRule = Literal["eq8", "alg2", "fixed_rho", "fixed"]
FLEET_VARIANCE: Final = (
    "its aggregation weights come from the fleet variance estimated over one round's cohort, "
    "which a buffer of updates from different model versions does not estimate"
)
StepUnit = Literal["steps", "epochs"]
OthersSet = Literal["all_registered", "active"]


class SelfFlConfig(AlgorithmConfig):
    """Self-FL, Algorithm 1 (selffl.md §2.7): adjusted init, adaptive steps, precision weights.

    The whole model is personal on the device and shared on the wire (selffl.md §2.4): it is
    trained from the Eq. (10) start for l_m steps (Eq. 8 via `step_rule`, clipped to [1,
    `l_max`]) and its delta goes up with sigma_m^2; `local_epochs`/`max_steps` are unused.
    `l_default` steps apply in warm-up, while estimates are missing, or with `step_rule`
    "fixed". `smoothing_beta` None means the participation rate C (A16). `per_sample_variance`
    (v^2, so sigma_m^2 = v^2/N_m) and `sigma0_sq` replace the estimates by oracle values
    (§5.9); `forgetting` < 1 discounts old rounds in Eq. (13) (A19, default exact).
    """

    name: ClassVar[str] = "selffl"
    capabilities: ClassVar[Capabilities] = Capabilities(
        aggregation="mean",
        clear_scalars="Self-FL weighs each update by the uncertainty its device reports and "
        "adapts its local steps to the spread of the devices' estimates",
        synchronous=FLEET_VARIANCE,
    )
    l_max: Annotated[int, Field(ge=1)] = 40
    l_default: Annotated[int, Field(ge=1)] = 20
    step_rule: StepRule = "eq8"
    step_unit: StepUnit = "steps"
    fixed_rho: Annotated[float, Field(gt=0, lt=1)] = 0.05
    on_invalid_rate: Literal["l_max", "one"] = "l_max"
    adjust_init: bool = True
    adaptive_steps: bool = True
    uncertainty_weights: bool = True
    smoothing_beta: Annotated[float, Field(gt=0, le=1)] | None = None
    warmup_rounds: Annotated[int, Field(ge=0)] = 0
    warmup_weights: AggregationWeights = "samples"
    fallback_weights: AggregationWeights = "uniform"
    eps: PositiveFloat = 1e-12
    others_set: OthersSet = "all_registered"
    min_activations: Annotated[int, Field(ge=2)] = 2
    forgetting: Annotated[float, Field(gt=0, le=1)] = 1.0
    send_updated_sigma: bool = False
    lagged_sigma0: bool = False
    per_sample_variance: PositiveFloat | None = None
    sigma0_sq: Annotated[float, Field(ge=0)] | None = None
    variance_exclude: tuple[str, ...] = ("*running_mean", "*running_var", "*num_batches_tracked")

    def compression_problem(self, uplink: Compression, downlink: str) -> str | None:
        """sigma_0^2 (Eq. 14) is the spread of the fleet's deltas: top-k would measure the codec.

        int8 adds at most (scale/2)^2 per entry to each delta's spread, which the estimate
        absorbs; a top-k delta is mostly zeros and residuals, so its spread is not the fleet's.
        """
        del downlink
        if uplink.codec == "topk":
            return (
                f"{self.name} weighs devices by the spread of their deltas (sigma_0^2), which "
                "top-k sparsification destroys: use --compress int8 or none"
            )
        return None


class SelfFlAugConfig(SelfFlConfig):
    """Self-FL, Algorithm 2 (selffl.md §3): also trains to a local optimum every round.

    The optimum theta_{m,t} (SGD on from the personal model until the epoch loss changes by
    less than `conv_tol` relatively, at most `conv_max_epochs` epochs) is what is uploaded,
    what sigma_m^2 is measured on and the Eq. (21) anchor; the step rule defaults to "alg2".
    """

    name: ClassVar[str] = "selffl-aug"
    capabilities: ClassVar[Capabilities] = Capabilities(
        aggregation="mean",
        clear_scalars="Self-FL weighs each update by the uncertainty its device reports",
        synchronous=FLEET_VARIANCE,
    )
    step_rule: StepRule = "alg2"
    conv_tol: Annotated[float, Field(ge=0)] = 1e-4
    conv_max_epochs: Annotated[int, Field(ge=1)] = 5


MStep = Literal["gradient", "delta"]
LossReduction = Literal["sum", "mean"]
LossTracking = Literal["ema", "cumulative"]
PeerSampling = Literal["per_round", "per_slot"]
UnseenPolicy = Literal["optimistic", "mask"]
ModelInit = Literal["independent", "shared"]
EStepData = Literal["train", "validation"]


class FedericoConfig(AlgorithmConfig):
    """FedeRiCo (federico.md §2.3): every device owns a whole model and learns whom to use.

    Each round a device samples `neighbours` (M) peer models epsilon-greedily (`epsilon`, one
    coin per round or per slot) on its private weights w = softmax(-L/`tau`), where L tracks each
    model's loss on the device's training data (summed, or averaged with `loss_reduction`
    "mean", which flattens w by the sample count) as an EMA with `beta` on the newest loss (or
    their running sum, "cumulative", the exact EM). The device evaluates itself plus its sample
    and sends each model's owner w-weighted contributions: full-batch gradients ("gradient"),
    applied by the owner's Adam at `lr` (`adam_*`), or the deltas of `local_epochs` SGD epochs
    at `local_lr` ("delta"), added as they are. Prediction mixes the models with w >=
    `min_weight` (at most `top_k`), never models the device has not evaluated. Models start from
    per-device seeds ("independent") or all from the coordinator's model ("shared", e.g. after
    `--pretrain-rounds`). M = 0 is local training (unseen models are then always masked).
    `estep_data` "validation" measures the E-step's losses on the validation split (§6.5: a
    held-out loss does not favour a device's own over-fitted model); "train" is Alg. 1's.
    """

    name: ClassVar[str] = "federico"
    capabilities: ClassVar[Capabilities] = Capabilities(
        aggregation="relay",
        clear_scalars=None,
        synchronous="devices train on peer models relayed within one round; relays across "
        "model versions have no defined rule",
    )
    comparable_update_norms: ClassVar[bool] = False
    """Each update moves the models its device evaluated, by its own collaborator weights, and
    each owner's Adam scales its model's step: norms of different devices' updates say nothing
    of each other (a 4x cut changed honest runs)."""
    stateful_only: ClassVar[bool] = True
    lr: PositiveFloat = 0.03  # the paper's Adam 0.01 loses to local training on sine
    batch_size: Annotated[int, Field(ge=1)] = 50
    neighbours: Annotated[int, Field(ge=0)] = 3
    epsilon: Annotated[float, Field(ge=0, le=1)] = 0.3
    beta: Annotated[float, Field(gt=0, le=1)] = 0.6
    tau: PositiveFloat = 1.0
    loss_reduction: LossReduction = "sum"
    loss_tracking: LossTracking = "ema"
    sampling: PeerSampling = "per_round"
    unseen_policy: UnseenPolicy = "optimistic"
    mstep: MStep = "gradient"
    local_lr: PositiveFloat = 0.01
    adam_beta1: Beta = 0.9
    adam_beta2: Beta = 0.999
    adam_eps: PositiveFloat = 1e-8
    min_weight: Annotated[float, Field(ge=0, lt=1)] = 1e-3
    top_k: Annotated[int, Field(ge=1)] | None = None
    init: ModelInit = "independent"
    estep_data: EStepData = "train"

    def relayed_models(self) -> int:
        """Its own model and M peers, each with a contribution."""
        return self.neighbours + 1

    def compression_problem(self, uplink: Compression, downlink: str) -> str | None:
        """Contributions go to each model's owner's Adam, and models travel by relay, not delta."""
        if uplink.lossy or downlink != "none":
            return (
                "federico sends per-owner contributions and relays whole per-device models, not "
                "one shared model and its delta: run it with --compress none --compress-down none"
            )
        return None

    @model_validator(mode="after")
    def _whole_models(self) -> FedericoConfig:
        if self.personal is not None or self.personal_preset not in (None, "none"):
            msg = "federico shares whole models with the peers that sample them: no personal part"
            raise ValueError(msg)
        return self


SELFFL_SIGMA_M_SQ: Final = "sigma_m_sq"
"""Self-FL uplink scalar: the device's sigma_m^2-hat (absent while undefined, A8)."""
SELFFL_LOCAL_STEPS: Final = "local_steps"
"""Self-FL uplink telemetry: the l_m the device ran."""
SELFFL_SIGMA0_SQ: Final = "sigma0_sq"
"""Self-FL downlink scalar: the server's latest sigma_0^2-hat."""
SELFFL_S_MINUS: Final = "s_minus"
"""Self-FL downlink scalar: S_{-m} = sum_{k != m} (sigma_0^2 + sigma_k^2)^{-1} (A2, §2.4)."""


ALGORITHM_CONFIGS: dict[str, type[AlgorithmConfig]] = {
    config.name: config
    for config in (
        LocalConfig,
        FedAvgConfig,
        FedAvgFtConfig,
        FedProxConfig,
        FedAltConfig,
        FedSimConfig,
        PFedMeConfig,
        PFedBreDConfig,
        DittoConfig,
        SelfFlConfig,
        SelfFlAugConfig,
        FedericoConfig,
    )
}


def algorithm_names() -> list[str]:
    """Every algorithm this build knows, sorted."""
    return sorted(ALGORITHM_CONFIGS)


def parse_algorithm_config(name: str, values: Mapping[str, object]) -> AlgorithmConfig:
    """Build the typed config of algorithm `name`.

    Raises:
        ValueError: unknown algorithm (the message names the valid ones) or invalid values.
    """
    config_type = ALGORITHM_CONFIGS.get(name)
    if config_type is None:
        msg = f"unknown algorithm {name!r}; choose one of: {', '.join(algorithm_names())}"
        raise ValueError(msg)
    try:
        return config_type.model_validate(dict(values))
    except ValidationError as error:
        problems = "; ".join(
            ": ".join(filter(None, (".".join(str(p) for p in e["loc"]), e["msg"])))
            for e in error.errors()
        )
        msg = f"invalid {name} settings: {problems}"
        raise ValueError(msg) from None


FEDERICO_ENTROPY: Final = "weight_entropy"
"""FedeRiCo uplink telemetry: the entropy (nats) of the device's collaborator weights."""
FEDERICO_COLLABORATORS: Final = "collaborators"
"""FedeRiCo uplink telemetry: how many models carry weight >= min_weight on the device."""
