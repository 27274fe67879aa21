"""The config every algorithm's extends: local-training settings, declared capabilities.

Each algorithm's own config lives in `protocols.algorithms`, which also selects them by name.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from protocols.capabilities import Capabilities
from protocols.messages import Compression, WireModel

PersonalDefault = Literal["none", "all", "task"]
PersonalPreset = Literal["none", "all", "output", "input", "split-input", "adapters", "fedbn"]
NormStats = Literal["personal", "shared"]
ServerOptimizerName = Literal["fedavg", "fedadam"]
AggregationWeights = Literal["samples", "uniform"]
RobustAggregation = Literal["mean", "median", "trimmed-mean", "centered-clipping"]
PositiveFloat = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]


class AlgorithmConfig(WireModel):
    """Local-training settings every algorithm shares.

    `personal` overrides which parameters stay on the device (fnmatch patterns over state_dict
    names); `personal_preset` names one of the paper's partitions instead, resolved against the
    model by `pfl_tasks.presets` (spec §2.1). Set at most one; with neither, the algorithm's default
    applies: "none" (everything shared), "all" (nothing shared) or "task" (the task's declared
    personal parameters).
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    """Declared by every registered algorithm itself (tests/protocols/test_capabilities.py)."""
    default_personal: ClassVar[PersonalDefault] = "none"
    stateful_only: ClassVar[bool] = False
    """Whether devices must keep state between rounds (no --stateless)."""
    comparable_update_norms: ClassVar[bool] = True
    """Whether every device's update moves the same model, so that one update's norm can be
    judged against the round's others (the guard's norm screen)."""

    local_epochs: Annotated[int, Field(ge=1)] = 1
    batch_size: Annotated[int, Field(ge=1)] = 10
    lr: PositiveFloat = 0.1
    max_steps: Annotated[int, Field(ge=1)] | None = None
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    clip_grad_norm: PositiveFloat | None = None
    personal: tuple[str, ...] | None = None
    personal_preset: PersonalPreset | None = None
    norm_stats: NormStats = "personal"
    """Normalization layers' running statistics (BatchNorm's running_mean/var): kept on each
    device (FedBN) or shared and averaged like parameters. A personal pattern or preset that
    covers a layer keeps its statistics personal either way; integer counters never leave."""

    def relayed_models(self) -> int:
        """Whole models a device holds at once in a round besides its own (relay algorithms)."""
        return 0

    def compression_problem(self, uplink: Compression, downlink: str) -> str | None:
        """Why this algorithm cannot run with these update and model codecs, or None."""
        del uplink, downlink
        return None

    def work_epochs(self) -> int:
        """Passes over a device's data one round's local training makes (its declared work).

        A simulated device's job lasts in proportion; `local_epochs` unless an algorithm says.
        """
        return self.local_epochs

    def weighs_equally(self) -> bool:
        """Whether its mean gives every device the same weight (else each its sample count).

        Secure aggregation then bounds each device's weight at 1 instead of its samples.
        """
        return False

    def needs_each_update(self) -> str | None:
        """Why these settings need each device's update one by one, not only their sum (or None)."""
        return None

    def clips_each_update(self) -> str | None:
        """How these settings clip each update on the coordinator (None: they do not)."""
        return None

    @model_validator(mode="after")
    def _one_personal_source(self) -> AlgorithmConfig:
        if self.personal is not None and self.personal_preset is not None:
            msg = "set either personal (patterns) or personal_preset, not both"
            raise ValueError(msg)
        return self
