"""Which of a model's tensors are shared across the fleet and which stay personal on the device."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from pfl_tasks.presets import resolve_preset
from protocols.algorithms import AlgorithmConfig


@dataclass(frozen=True)
class ParamSplit:
    """A partition of a model's state_dict names into shared and personal, in state_dict order."""

    shared: tuple[str, ...]
    personal: tuple[str, ...]

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


def resolve_split(
    model: nn.Module, task_personal: Iterable[str], config: AlgorithmConfig
) -> ParamSplit:
    """The split an algorithm trains with: `personal`, else `personal_preset`, else its default.

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
        return ParamSplit.from_patterns(names, config.personal)
    if config.personal_preset is not None:
        return ParamSplit.from_patterns(names, resolve_preset(config.personal_preset, model))
    defaults = {"none": (), "all": ("*",), "task": tuple(task_personal)}
    return ParamSplit.from_patterns(names, defaults[config.default_personal])
