"""Typed configuration of every algorithm, selected by name through one registry.

A config travels inside each RoundAnnouncement, so a device always trains with exactly the
hyperparameters the coordinator chose for that round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import Field, ValidationError

from protocols.messages import WireModel

PersonalDefault = Literal["none", "all", "task"]
PositiveFloat = Annotated[float, Field(gt=0)]


class AlgorithmConfig(WireModel):
    """Local-training settings every algorithm shares.

    `personal` overrides which parameters stay on the device (fnmatch patterns over state_dict
    names); None takes the algorithm's default: "none" (everything shared), "all" (nothing
    shared) or "task" (the task's declared personal parameters).
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


class LocalConfig(AlgorithmConfig):
    """Each device trains alone; nothing is shared (the no-federation baseline)."""

    name: ClassVar[str] = "local"
    default_personal: ClassVar[PersonalDefault] = "all"


class FedAvgConfig(AlgorithmConfig):
    """FedAvg: sample-weighted mean of shared deltas, applied with a server step size."""

    name: ClassVar[str] = "fedavg"
    server_lr: PositiveFloat = 1.0


class FedAvgFtConfig(FedAvgConfig):
    """FedAvg, then each device fine-tunes the final model on its own data before use."""

    name: ClassVar[str] = "fedavg-ft"
    finetune_epochs: Annotated[int, Field(ge=0)] = 3
    finetune_lr: PositiveFloat = 0.02


class FedProxConfig(FedAvgConfig):
    """FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in the local loss."""

    name: ClassVar[str] = "fedprox"
    mu: Annotated[float, Field(ge=0)] = 0.01


ALGORITHM_CONFIGS: dict[str, type[AlgorithmConfig]] = {
    config.name: config for config in (LocalConfig, FedAvgConfig, FedAvgFtConfig, FedProxConfig)
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
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        msg = f"invalid {name} settings: {problems}"
        raise ValueError(msg) from None
