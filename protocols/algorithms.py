"""Typed configuration of every algorithm, selected by name through one registry.

A config travels inside each RoundAnnouncement, so a device always trains with exactly the
hyperparameters the coordinator chose for that round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import Field, ValidationError, model_validator

from protocols.messages import WireModel

PersonalDefault = Literal["none", "all", "task"]
PersonalPreset = Literal["none", "all", "output", "input", "split-input", "adapters"]
ServerOptimizerName = Literal["fedavg", "fedadam"]
AggregationWeights = Literal["samples", "uniform"]
PositiveFloat = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]


class AlgorithmConfig(WireModel):
    """Local-training settings every algorithm shares.

    `personal` overrides which parameters stay on the device (fnmatch patterns over state_dict
    names); `personal_preset` names one of the paper's partitions instead, resolved against the
    model by `tasks.presets` (spec §2.1). Set at most one; with neither, the algorithm's default
    applies: "none" (everything shared), "all" (nothing shared) or "task" (the task's declared
    personal parameters).
    """

    name: ClassVar[str]
    default_personal: ClassVar[PersonalDefault] = "none"

    local_epochs: Annotated[int, Field(ge=1)] = 1
    batch_size: Annotated[int, Field(ge=1)] = 10
    lr: PositiveFloat = 0.1
    max_steps: Annotated[int, Field(ge=1)] | None = None
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    clip_grad_norm: PositiveFloat | None = None
    personal: tuple[str, ...] | None = None
    personal_preset: PersonalPreset | None = None

    @model_validator(mode="after")
    def _one_personal_source(self) -> AlgorithmConfig:
        if self.personal is not None and self.personal_preset is not None:
            msg = "set either personal (patterns) or personal_preset, not both"
            raise ValueError(msg)
        return self


class LocalConfig(AlgorithmConfig):
    """Each device trains alone; nothing is shared (the no-federation baseline)."""

    name: ClassVar[str] = "local"
    default_personal: ClassVar[PersonalDefault] = "all"


class FedAvgConfig(AlgorithmConfig):
    """FedAvg and its adaptive variants (Reddi et al. 2021): mean shared delta, then a server step.

    `server_optimizer` "fedavg" is server SGD, u + server_lr * mean delta; "fedadam" is Adam on
    the pseudo-gradient -mean delta with bias correction (spec §1.5, §7.3). Deltas are weighted
    by the devices' sample counts or uniformly (spec §7.2), renormalized over the reporters.
    """

    name: ClassVar[str] = "fedavg"
    server_lr: PositiveFloat = 1.0
    server_optimizer: ServerOptimizerName = "fedavg"
    adam_beta1: Beta = 0.9
    adam_beta2: Beta = 0.999
    adam_eps: PositiveFloat = 1e-8
    aggregation_weights: AggregationWeights = "samples"


class FedAvgFtConfig(FedAvgConfig):
    """FedAvg, then each device fine-tunes the final model on its own data before use."""

    name: ClassVar[str] = "fedavg-ft"
    finetune_epochs: Annotated[int, Field(ge=0)] = 3
    finetune_lr: PositiveFloat = 0.02


class FedProxConfig(FedAvgConfig):
    """FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in the local loss."""

    name: ClassVar[str] = "fedprox"
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
    personal_epochs: Annotated[int, Field(ge=0)] | None = None
    personal_max_steps: Annotated[int, Field(ge=1)] | None = None


class FedSimConfig(PartialConfig):
    """FedSim (spec §1.4): tau steps (`local_epochs`/`max_steps`) move u and v together."""

    name: ClassVar[str] = "fedsim"


ALGORITHM_CONFIGS: dict[str, type[AlgorithmConfig]] = {
    config.name: config
    for config in (
        LocalConfig,
        FedAvgConfig,
        FedAvgFtConfig,
        FedProxConfig,
        FedAltConfig,
        FedSimConfig,
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
