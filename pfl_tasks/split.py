"""Which of a model's tensors are shared across the fleet and which stay personal on the device."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from pfl_tasks.presets import resolve_preset
from protocols.algorithms import AlgorithmConfig

StateKind = Literal["parameter", "statistic", "counter", "buffer"]
"""What a state_dict tensor is: a trained parameter; a normalization layer's running statistic
(float, estimated from the data, not trained); an integer counter (BatchNorm's
`num_batches_tracked`); or another float buffer (carried as the split says)."""


@dataclass(frozen=True)
class ParamSplit:
    """A partition of a model's state_dict names into shared and personal, in state_dict order."""

    shared: tuple[str, ...]
    personal: tuple[str, ...]
    by_kind: tuple[str, ...] = ()
    """The personal names that are personal by their kind (statistics, counters), not by the
    patterns: the device's own even in its copy of the global model (FedBN evaluates that way)."""

    @classmethod
    def from_patterns(cls, names: Iterable[str], personal_patterns: Iterable[str]) -> ParamSplit:
        """Personal = names matching any fnmatch pattern (a module prefix matches its tensors)."""
        patterns = tuple(personal_patterns)
        shared: list[str] = []
        personal: list[str] = []
        for name in names:
            is_personal = any(
                fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".")
                for pattern in patterns
            )
            (personal if is_personal else shared).append(name)
        return cls(tuple(shared), tuple(personal))

    @classmethod
    def for_model(cls, model: nn.Module, personal_patterns: Iterable[str]) -> ParamSplit:
        """The split of `model`'s state_dict (parameters and buffers)."""
        return cls.from_patterns(model.state_dict().keys(), personal_patterns)


def state_kinds(model: nn.Module) -> dict[str, StateKind]:
    """Each of `model`'s state_dict names with its kind, in state_dict order.

    Statistics are the running mean and variance of every normalization layer that tracks them
    (BatchNorm 1d/2d/3d, SyncBatchNorm, InstanceNorm with track_running_stats); a counter is any
    integer tensor, wherever it sits.
    """
    state = model.state_dict()
    parameters = {name for name, _ in model.named_parameters()}
    statistics = {
        f"{prefix}.{buffer}" if prefix else buffer
        for prefix, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._NormBase)
        for buffer in ("running_mean", "running_var")
        if getattr(module, buffer, None) is not None
    }
    kinds: dict[str, StateKind] = {}
    for name, value in state.items():
        if not value.is_floating_point():
            kinds[name] = "counter"
        elif name in parameters:
            kinds[name] = "parameter"
        else:
            kinds[name] = "statistic" if name in statistics else "buffer"
    return kinds


def with_state_kinds(
    split: ParamSplit, kinds: Mapping[str, StateKind], norm_stats: str = "personal"
) -> ParamSplit:
    """`split` with counters always personal, and statistics too unless `norm_stats` is "shared".

    A counter is never averaged nor sent: a float mean of step counts means nothing, and its
    exact value tells how many local steps (hence samples) a device trained on, which no clip or
    noise covers. Statistics stay with the data they describe by default (FedBN, Li et al.
    2021); shared, they are averaged like parameters, weighted as the algorithm weighs deltas.
    """
    kept = {"counter"} if norm_stats == "shared" else {"counter", "statistic"}
    moved = {name for name in split.shared if kinds.get(name) in kept}
    if not moved:
        return split
    personal = set(split.personal) | moved
    return ParamSplit(
        tuple(name for name in split.shared if name not in moved),
        tuple(name for name in kinds if name in personal),
        tuple(name for name in kinds if name in moved),
    )


def resolve_split(
    model: nn.Module, task_personal: Iterable[str], config: AlgorithmConfig
) -> ParamSplit:
    """The split an algorithm trains with: `personal`, else `personal_preset`, else its default.

    Then counters, and statistics unless `config.norm_stats` is "shared", move to personal.

    Raises:
        ValueError: an override pattern matches no tensor of the model (the message lists them),
            or the preset does not apply to the model (see `pfl_tasks.presets.resolve_preset`).
    """
    names = list(model.state_dict().keys())
    if config.personal is not None:
        for pattern in config.personal:
            if not ParamSplit.from_patterns(names, (pattern,)).personal:
                msg = (
                    f"personal pattern {pattern!r} matches no tensor; "
                    f"the model has: {', '.join(names)}"
                )
                raise ValueError(msg)
        patterns: tuple[str, ...] = config.personal
    elif config.personal_preset is not None:
        patterns = resolve_preset(config.personal_preset, model)
    else:
        defaults = {"none": (), "all": ("*",), "task": tuple(task_personal)}
        patterns = defaults[config.default_personal]
    split = ParamSplit.from_patterns(names, patterns)
    return with_state_kinds(split, state_kinds(model), config.norm_stats)
