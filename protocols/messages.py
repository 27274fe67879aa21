"""Every message pfl-edge exchanges, as frozen pydantic models on one base.

A message travels as a frame (see `protocols.codec`): this header, validated here, followed by the
tensors its `manifest` describes. `parse_header` is the one entry point for anything inbound.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from protocols.errors import ProtocolError
from protocols.versions import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS

SEGMENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A device id or fleet name: one MQTT topic segment with no wildcards or separators."""

DeviceId = Annotated[str, Field(pattern=SEGMENT_PATTERN)]
TensorName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:/-]+$")]
DType = Literal[
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"
]


def _require_finite(value: float) -> float:
    if not math.isfinite(value):
        msg = f"expected a finite number, got {value}"
        raise ValueError(msg)
    return value


FiniteFloat = Annotated[float, AfterValidator(_require_finite)]
MAX_MAGNITUDE = 1e30
"""The largest absolute value a device's loss or scalar may have (float32 tops out at 3.4e38)."""
BoundedFloat = Annotated[FiniteFloat, Field(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]
MAX_COUNT = 10**12
"""The largest sample count a message may carry; the coordinator's own limit is lower."""
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
RunId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
"""One run of a coordinator (a random UUID's hex): new on a fresh start, kept on `--resume`.
Answers carry it back, so nothing from an earlier run is taken for the current one."""
MAX_PEERS = 100_000
"""Most model owners one message may name (the candidate list of a relay round)."""
Scalars = dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], BoundedFloat]
"""An algorithm's named scalars (e.g. Self-FL's sigma_m^2): finite numbers only."""


def _check_version(version: int) -> int:
    if version not in SUPPORTED_PROTOCOL_VERSIONS:
        msg = f"unsupported protocol version {version}; this build speaks {PROTOCOL_VERSION}"
        raise ValueError(msg)
    return version


class WireModel(BaseModel):
    """Base of every part of the wire contract: strict about unknown fields, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Message(WireModel):
    """Base of every top-level message: a version and a send time."""

    protocol_version: Annotated[int, AfterValidator(_check_version)] = PROTOCOL_VERSION
    sent_at: float = Field(default_factory=time.time)


class TensorSpec(WireModel):
    """Name, dtype and shape of one tensor in a frame."""

    name: TensorName
    dtype: DType
    shape: tuple[NonNegativeInt, ...]


class TensorManifest(WireModel):
    """What tensors a frame carries, and the SHA-256 and length of their encoded bytes."""

    tensors: tuple[TensorSpec, ...] = ()
    byte_length: NonNegativeInt = 0
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] = hashlib.sha256(b"").hexdigest()


class MemoryPlan(WireModel):
    """How a device will train within its memory budget."""

    budget_bytes: NonNegativeInt
    estimated_peak_bytes: NonNegativeInt
    micro_batch_size: Annotated[int, Field(ge=1)]
    accumulation_steps: Annotated[int, Field(ge=1)]
    method: Literal["estimate", "probe"] = "estimate"
    checkpointing: bool = False
    """Whether the model's top-level blocks are recomputed in backward to fit the budget."""


class Capabilities(WireModel):
    """What a device can offer, sent with its hello."""

    cores: Annotated[int, Field(ge=1)]
    memory_bytes: NonNegativeInt
    arch: str = Field(max_length=64)
    torch_version: str = Field(max_length=64)
    python_version: str = Field(max_length=32)


class Eligibility(WireModel):
    """The conditions a device trains under (None: not checked), as its agent is configured."""

    min_free_memory_bytes: NonNegativeInt | None = None
    max_load_per_core: Annotated[float, Field(ge=0, le=MAX_MAGNITUDE)] | None = None
    require_mains_power: bool = False


class DeviceHello(Message):
    """A device announcing itself: who it is, what it runs and how much data it holds."""

    kind: Literal["hello"] = "hello"
    device_id: DeviceId
    task: str = Field(max_length=256)
    num_train_samples: Count
    capabilities: Capabilities
    memory_plan: MemoryPlan | None = None
    stateful: bool = True
    instance: str = Field(default="", pattern=r"^[0-9a-f]{0,32}$")
    """A random token per agent process: two running at once under one id show as a clash."""
    eligibility: Eligibility = Field(default_factory=Eligibility)


class DeviceStatus(Message):
    """A device's liveness and progress; retained, with an "offline" last-will."""

    kind: Literal["status"] = "status"
    device_id: DeviceId
    state: Literal["online", "training", "evaluating", "exporting", "skipped", "offline"]
    round_id: NonNegativeInt | None = None
    run_id: RunId | None = None
    """With `round_id`: the run of the round this status is about (e.g. the one skipped)."""
    last_loss: BoundedFloat | None = None
    detail: str = Field(default="", max_length=1024)


MAX_STATUS_EVENTS = 20
"""Events a coordinator status carries (the latest): what an operator should notice lately."""
MAX_LISTED_MISSING = 100
"""Missing devices a coordinator status names (the first by id); `missing_count` counts all."""


class RunEvent(WireModel):
    """Something the coordinator wants an operator to notice: a stall, a failed round, a stop."""

    at: float
    """When it happened (epoch seconds)."""
    level: Literal["info", "warn", "error"] = "info"
    text: str = Field(max_length=1024)


class CoordinatorStatus(Message):
    """The coordinator's liveness and progress; retained, with an "offline" last-will.

    `waiting`: a round waits for the devices in `missing` until `deadline`. `stalled`: nothing
    has arrived for a while (half the round timeout) although devices are missing, or the run
    waits for devices to come back; `reason` says which. `stopped`: the run ended early, `reason`
    says why (privacy budget spent, interrupted, every round skipped, an error).
    """

    kind: Literal["coordinator-status"] = "coordinator-status"
    state: Literal["online", "running", "waiting", "stalled", "finished", "stopped", "offline"]
    fleet: DeviceId
    task: str = Field(default="", max_length=256)
    algorithm: str = Field(default="", max_length=64)
    round_id: NonNegativeInt | None = None
    rounds: NonNegativeInt | None = None
    missing: tuple[DeviceId, ...] = Field(default=(), max_length=MAX_LISTED_MISSING)
    """Waiting or stalled: devices asked that have neither answered nor declined (first by id)."""
    missing_count: NonNegativeInt = 0
    """How many devices are missing in all (`missing` names at most MAX_LISTED_MISSING)."""
    deadline: float | None = None
    """Waiting or stalled in a round: when the round stops waiting (epoch seconds)."""
    reason: str = Field(default="", max_length=1024)
    events: tuple[RunEvent, ...] = Field(default=(), max_length=MAX_STATUS_EVENTS)
    """The latest events, oldest first."""


class FleetDevice(WireModel):
    """One device as the coordinator's registry sees it."""

    device_id: DeviceId
    online: bool
    last_seen: float
    round_id: NonNegativeInt | None = None
    last_loss: BoundedFloat | None = None
    num_train_samples: NonNegativeInt = 0
    memory_plan: MemoryPlan | None = None
    eligibility: Eligibility = Field(default_factory=Eligibility)
    detail: str = Field(default="", max_length=1024)
    dropped: NonNegativeInt = 0
    """Messages from this device the coordinator dropped (malformed, stale, over a limit)."""
    quarantined: bool = False
    """Over its limit of dropped messages this round: ignored until the next round starts."""
    flapping: bool = False
    """Rejoined several times within seconds: two devices probably share this id."""
    rounds_taken: NonNegativeInt = 0
    """Training rounds whose update the coordinator accepted from this device."""
    declines: NonNegativeInt = 0
    """Rounds it declined (not eligible: battery, memory, network); the last reason below."""
    last_decline: str = Field(default="", max_length=1024)
    bytes_up: NonNegativeInt = 0
    """Payload bytes received from this device during the run."""
    bytes_down: NonNegativeInt = 0
    """Payload bytes sent for this device: the models it downloads, a share of each broadcast."""
    round_seconds: Annotated[float, Field(ge=0, le=MAX_MAGNITUDE)] | None = None
    """From the last training announcement to its update (None: no update yet): stragglers."""
    missed_deadlines: NonNegativeInt = 0
    """Rounds it was selected for and let the deadline pass while connected, without an answer."""
    missed_round: NonNegativeInt | None = None
    """The last such round: in the fleet status of that round, the device is a straggler."""


class FleetStatus(Message):
    """The coordinator's whole view of the fleet: every device's row, the round and its scalars.

    Not sent as one message: the broker retains it paged (a `FleetSummary` and a `FleetRow` per
    device), which readers join into this; a run directory's `fleet.json` holds it whole.
    Devices need not publish a status every round: their round and loss come from here.
    """

    kind: Literal["fleet-status"] = "fleet-status"
    fleet: DeviceId
    round_id: NonNegativeInt
    devices: tuple[FleetDevice, ...] = ()
    scalars: Scalars = Field(default_factory=dict)
    """The last round's fleet scalars (e.g. Self-FL's sigma_0^2), as in metrics.jsonl."""


FLEET_EPOCH_PATTERN = r"^[0-9a-f]{1,32}$"


class FleetSummary(Message):
    """The fleet's counts after each round, retained beside one `FleetRow` per device.

    Small and of fixed size: what a round costs the coordinator does not grow with the fleet.
    """

    kind: Literal["fleet-summary"] = "fleet-summary"
    fleet: DeviceId
    epoch: Annotated[str, Field(pattern=FLEET_EPOCH_PATTERN)]
    """The publishing coordinator's incarnation: rows of another (an earlier run's) are stale."""
    round_id: NonNegativeInt
    registered: Count = 0
    online: Count = 0
    quarantined: Count = 0
    flapping: Count = 0
    stragglers: Count = 0
    """Devices that let round `round_id`'s deadline pass while connected."""
    strangers: Count = 0
    """Senders listed (rows) although they never joined."""
    broadcast_bytes: NonNegativeInt = 0
    """Bytes broadcast to every online device so far; a row's `broadcast_mark` is subtracted."""
    scalars: Scalars = Field(default_factory=dict)
    """The last round's fleet scalars (e.g. Self-FL's sigma_0^2), as in metrics.jsonl."""


class FleetRow(Message):
    """One device's row of the fleet status, retained on its own topic; republished on change.

    Its `bytes_down` counts broadcasts up to `broadcast_mark`; while the device stays online,
    each later broadcast also reached it: the summary's `broadcast_bytes` minus the mark.
    """

    kind: Literal["fleet-row"] = "fleet-row"
    fleet: DeviceId
    epoch: Annotated[str, Field(pattern=FLEET_EPOCH_PATTERN)]
    device: FleetDevice
    broadcast_mark: NonNegativeInt | None = None
    """The summary's `broadcast_bytes` when this row's count was settled (None: offline)."""
    stranger: bool = False
    """A sender that never joined, listed for the messages it had dropped."""


RUN_HISTORY_ROUNDS = 1000
"""Rounds a run history keeps (the latest): a late dashboard sees the trend, not every round."""
MAX_RUN_SETTINGS = 200


class RoundSummary(WireModel):
    """One finished training round, as metrics.jsonl records it."""

    round_id: NonNegativeInt
    selected: NonNegativeInt
    participants: NonNegativeInt
    skipped: NonNegativeInt = 0
    dropped: NonNegativeInt = 0
    """Messages the coordinator dropped during the round (malformed, stale, over a limit)."""
    train_loss: BoundedFloat | None = None
    bytes_up: NonNegativeInt = 0
    bytes_down: NonNegativeInt = 0
    wall_seconds: Annotated[float, Field(ge=0, le=MAX_MAGNITUDE)] = 0.0
    finished_at: Annotated[float, Field(ge=0, le=MAX_MAGNITUDE)] | None = None
    """When the round ended (epoch seconds): a clock-time axis (None: not recorded)."""
    scalars: Scalars = Field(default_factory=dict)
    evaluation: dict[str, BoundedFloat | None] | None = Field(default=None, max_length=64)


class DeviceResult(WireModel):
    """A device's latest held-out result: what personalization gained it, against its data."""

    device_id: DeviceId
    round_id: NonNegativeInt
    metric_name: Literal["accuracy", "mse"]
    personalized: BoundedFloat
    global_model: BoundedFloat | None = None
    num_train_samples: Count


class RunHistory(Message):
    """The run so far, for dashboards; retained, readable by operators and not by devices."""

    kind: Literal["run-history"] = "run-history"
    fleet: DeviceId
    run_id: RunId
    settings: dict[
        Annotated[str, Field(max_length=64)],
        Annotated[str, Field(max_length=256)] | BoundedFloat | bool | None,
    ] = Field(default_factory=dict, max_length=MAX_RUN_SETTINGS)
    """The run's configuration (task, algorithm, rounds, ...), flattened to scalars."""
    rounds: tuple[RoundSummary, ...] = Field(default=(), max_length=RUN_HISTORY_ROUNDS)
    devices: tuple[DeviceResult, ...] = Field(default=(), max_length=1_000_000)


class Compression(WireModel):
    """How a delta travels: dense float32 (`none`), `int8`, or `topk` of a fraction of entries."""

    codec: Literal["none", "int8", "topk"] = "none"
    fraction: Annotated[float, Field(gt=0, le=1)] = 1.0
    """topk: the share of entries sent."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """int8: round to the nearest level, or up/down with the probability that makes it unbiased."""

    @model_validator(mode="after")
    def _options_fit_codec(self) -> Compression:
        if self.fraction != 1.0 and self.codec != "topk":
            msg = f"a fraction applies to topk only, not to {self.codec}"
            raise ValueError(msg)
        if self.rounding != "nearest" and self.codec != "int8":
            msg = f"stochastic rounding applies to int8 only, not to {self.codec}"
            raise ValueError(msg)
        return self

    @classmethod
    def parse(cls, text: str) -> Compression:
        """`none`, `int8`, `int8:stochastic` or `topk:<fraction>` (e.g. `topk:0.01`).

        Raises:
            ValueError: anything else, with the accepted forms.
        """
        name, _, option = text.strip().lower().partition(":")
        try:
            if name in ("none", "int8") and not option:
                return cls(codec=name)  # type: ignore[arg-type]
            if name == "int8" and option == "stochastic":
                return cls(codec="int8", rounding="stochastic")
            if name == "topk" and option:
                fraction = float(option)
                if not 0 < fraction <= 1:
                    raise ValueError
                return cls(codec="topk", fraction=fraction)
        except ValueError:  # a fraction outside (0, 1] or not a number
            msg = f"invalid compression {text!r}: the top-k fraction is a number in (0, 1]"
            raise ValueError(msg) from None
        msg = f"invalid compression {text!r}: use none, int8, int8:stochastic or topk:<fraction>"
        raise ValueError(msg)

    def __str__(self) -> str:
        if self.codec == "topk":
            return f"topk:{self.fraction:g}"
        if self.codec == "int8" and self.rounding == "stochastic":
            return "int8:stochastic"
        return self.codec

    @property
    def lossy(self) -> bool:
        """Whether decoding loses information (and error feedback has something to carry)."""
        return self.codec != "none"


class DevicePrivacy(WireModel):
    """What a round's differential privacy asks of each selected device (see protocols.privacy).

    The device clips its shared delta to `clip_norm`, adds N(0, noise_std^2) per entry (0 when
    the coordinator adds the noise), reports no loss, sample count or algorithm scalars, and,
    with `report_clipped`, +1/2 if its delta was within the clip and -1/2 if not, plus
    N(0, indicator_std^2).
    """

    clip_norm: Annotated[float, Field(gt=0, le=1e6)]
    noise_std: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    report_clipped: bool = False
    indicator_std: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    discrete: bool = False
    """Add the noise as N_Z(0, noise_std^2) on secure aggregation's integer grid instead
    (`protocols.discrete_gaussian`): the delta is only clipped before it is masked."""


class SecureRound(WireModel):
    """What a round's secure aggregation asks of each selected device.

    The device clips its shared delta to `clip_norm` (unless DP already did), multiplies it by
    its weight (its sample count up to `weight_bound`; 1 when `weight_bound` is 1), and sums,
    masked, the groups the layout lists; it reports nothing else. It answers an unmasking only
    for at least `min_survivors` survivors.
    """

    threshold: Annotated[float, Field(gt=0.5, le=1)]
    neighbors: Annotated[int, Field(ge=0, le=10_000)] = 0
    cohort: Annotated[int, Field(ge=3, le=MAX_PEERS)]
    min_survivors: Annotated[int, Field(ge=3, le=MAX_PEERS)]
    clip_norm: Annotated[float, Field(gt=0, le=1e6)]
    value_bound: Annotated[float, Field(gt=0, le=1e9)]
    """Each delta entry is clamped to +-value_bound (the clip norm, plus room for DP noise)."""
    weight_bound: Annotated[int, Field(ge=1, le=10**9)] = 1
    loss_bound: Annotated[float, Field(ge=0, le=1e9)] = 0.0
    """0: neither the weighted loss nor the count of clipped deltas is summed (under DP)."""
    bit_bound: Annotated[float, Field(ge=0, le=1e9)] = 0.0
    """Above 0: DP's noised within-clip bit is summed, clamped to +-bit_bound."""
    phase_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 60.0
    int8: bool = False
    """The delta is summed as int8 levels (step weight_bound * value_bound / 127, rounded
    stochastically) in the smallest ring that holds the cohort's sum, not as 32-bit fixed point
    (`protocols.secure_aggregation.level_bits`)."""


class SharedModel(Message):
    """The shared parameters the coordinator holds; retained, so late devices catch up."""

    kind: Literal["shared-model"] = "shared-model"
    round_id: NonNegativeInt
    manifest: TensorManifest


class ModelDelta(Message):
    """The shared model as an int8 delta from the one before it (compressed downlink).

    Retained beside the whole model. A device holding exactly `base_sha256` adds the decoded
    tensors the manifest lists (int8 with per-tensor scales, `protocols.compression`) to it; the
    result's manifest SHA-256 must equal `target_sha256`, else it fetches the whole model.
    """

    kind: Literal["model-delta"] = "model-delta"
    round_id: NonNegativeInt
    base_sha256: Digest
    target_sha256: Digest
    manifest: TensorManifest


class DeviceAssignment(WireModel):
    """What one selected device receives beyond the shared model (algorithm scalars)."""

    scalars: Scalars = Field(default_factory=dict)


class RoundAnnouncement(Message):
    """A call for work on the current shared model: train, evaluate or export.

    `model_sha256` names the SharedModel the work uses. `selected` lists the devices asked to
    answer (with `assignments` holding the scalars of those that have any); both empty means
    every device. Every device receives the announcement, so it stays small: ids only.
    """

    kind: Literal["round"] = "round"
    run_id: RunId
    round_id: NonNegativeInt
    phase: Literal["train", "evaluate", "export"]
    algorithm: str = Field(max_length=64)
    config: dict[str, Any] = Field(default_factory=dict)
    model_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    deadline_s: Annotated[float, Field(gt=0)] = 600.0
    selected: tuple[DeviceId, ...] = Field(default=(), max_length=MAX_PEERS)
    assignments: dict[DeviceId, DeviceAssignment] = Field(default_factory=dict)
    final: bool = False
    peers: tuple[DeviceId, ...] = Field(default=(), max_length=MAX_PEERS)
    """The model owners a relay algorithm's devices may ask for (FedeRiCo); empty otherwise."""
    uplink: Compression = Field(default_factory=Compression)
    """How devices encode the delta they send back (the run's `--compress`)."""
    delta_base_sha256: Digest | None = None
    """The model a retained `ModelDelta` to `model_sha256` starts from (None: no delta)."""
    privacy: DevicePrivacy | None = None
    """Differential privacy for this round's updates (None: none)."""
    secure: SecureRound | None = None
    """Secure aggregation of this round's updates (None: plain updates)."""
    asynchronous: bool = False
    """Asynchronous rounds: train on the model retained when this device fetches, which may be
    newer than `model_sha256` (the coordinator counts staleness from `round_id`)."""

    def addresses(self, device_id: str) -> bool:
        """Whether this announcement asks `device_id` to answer."""
        if not self.selected and not self.assignments:
            return True
        return device_id in self.assignments or device_id in self.selected


class PeerRequest(Message):
    """A device asking the coordinator for models of the fleet (FedeRiCo's relay).

    `models` names the owners whose current models the device needs this round: for training
    itself first, then the peers it sampled. `cached` gives the digest of each copy the device
    already holds, so an unchanged model is not sent again. Nothing here reveals a loss or a
    collaborator weight, only which models the device asked for.
    """

    kind: Literal["peer-request"] = "peer-request"
    run_id: RunId
    round_id: NonNegativeInt
    phase: Literal["train", "evaluate"]
    device_id: DeviceId
    models: tuple[DeviceId, ...] = Field(min_length=1, max_length=MAX_PEERS)
    cached: dict[DeviceId, Digest] = Field(default_factory=dict, max_length=MAX_PEERS)

    @model_validator(mode="after")
    def _distinct(self) -> PeerRequest:
        if len(set(self.models)) != len(self.models):
            msg = "models must not repeat an owner"
            raise ValueError(msg)
        return self


class RelayedModel(WireModel):
    """One owner's model in a relay: its digest, and whether its tensors are in this frame."""

    owner: DeviceId
    digest: Digest
    sent: bool
    """False when the device's cached copy (same digest) is current: nothing was resent."""


class PeerModels(Message):
    """The coordinator's answer to a PeerRequest: the models, as `<owner>/<tensor>` tensors.

    `missing` lists owners the coordinator holds no model for; the device treats them as not
    sampled this round.
    """

    kind: Literal["peer-models"] = "peer-models"
    round_id: NonNegativeInt
    phase: Literal["train", "evaluate"]
    device_id: DeviceId
    models: tuple[RelayedModel, ...] = Field(max_length=MAX_PEERS)
    missing: tuple[DeviceId, ...] = Field(default=(), max_length=MAX_PEERS)
    manifest: TensorManifest


class DeviceUpdate(Message):
    """A device's answer to a training round: shared-parameter delta plus scalars only."""

    kind: Literal["update"] = "update"
    run_id: RunId
    round_id: NonNegativeInt
    device_id: DeviceId
    algorithm: str = Field(max_length=64)
    num_samples: Count
    train_loss: BoundedFloat
    scalars: Scalars = Field(default_factory=dict)
    compression: Compression = Field(default_factory=Compression)
    """How the delta's tensors are encoded: the round's `uplink`, anything else is refused."""
    within_clip: BoundedFloat | None = None
    """Under adaptive clipping: 1 if the delta was within the clip norm, else 0, plus noise."""
    manifest: TensorManifest


METRIC_RANGES: dict[str, tuple[float, float]] = {
    "accuracy": (0.0, 1.0),
    "mse": (0.0, MAX_MAGNITUDE),
}
"""The values a metric takes whatever the task: a fraction, or a mean of squares. How large an
error may be depends on the task's targets: the coordinator bounds that (`check_evaluation`)."""


class EvaluationReport(Message):
    """A device's held-out metrics for its personalized model and for the shared global model."""

    kind: Literal["evaluation"] = "evaluation"
    run_id: RunId
    round_id: NonNegativeInt
    device_id: DeviceId
    metric_name: Literal["accuracy", "mse"]
    personalized: BoundedFloat
    global_model: BoundedFloat | None = None
    num_test_samples: Count
    num_train_samples: Count

    @model_validator(mode="after")
    def _within_the_metric_range(self) -> EvaluationReport:
        low, high = METRIC_RANGES[self.metric_name]
        for value in (self.personalized, self.global_model):
            if value is not None and not low <= value <= high:
                msg = f"{self.metric_name} {value:g} is outside its range [{low:g}, {high:g}]"
                raise ValueError(msg)
        return self


class ExportArguments(WireModel):
    """What an export command asks of each device: where to write, int8 beside it, the guard."""

    out_dir: str = Field(default="", max_length=4096)
    """The folder on the device for `<device_id>.onnx`; empty for its state directory."""
    quantize: Literal["int8", "int8-static"] | None = None
    guard: bool = False
    """Ship the global model where it validates better than the personalized one."""

    @classmethod
    def checked(cls, **values: Any) -> ExportArguments:
        """The options from a command line, or one ValueError line naming the bad option."""
        try:
            return cls(**values)
        except ValidationError as error:
            msg = f"export option {first_problem(error)}"
            raise ValueError(msg) from None


class Command(Message):
    """An instruction to one device (or all) outside the round flow."""

    kind: Literal["command"] = "command"
    action: Literal["export", "reset-state", "shutdown", "hello"]
    round_id: NonNegativeInt | None = None
    export: ExportArguments | None = None
    """The options of action="export" (None: every default)."""


class ExportReport(Message):
    """What a device says about the ONNX file it wrote; never the model itself."""

    kind: Literal["export-report"] = "export-report"
    round_id: NonNegativeInt
    device_id: DeviceId
    ok: bool
    path: str = Field(default="", max_length=4096)
    size_bytes: NonNegativeInt = 0
    sha256: str = Field(default="", max_length=64)
    parity_max_abs_diff: FiniteFloat | None = None
    metrics: Scalars = Field(default_factory=dict)
    error: str = Field(default="", max_length=4096)


PublicKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
"""An X25519 public key: 32 bytes as hex."""
Sealed = Annotated[str, Field(pattern=r"^[0-9a-f]{56,1024}$")]
"""A share bundle sealed for one holder (nonce, ChaCha20-Poly1305 ciphertext), as hex."""
ShareHex = Annotated[str, Field(pattern=r"^[0-9a-f]{132}$")]
SaltHex = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
MAX_NEIGHBOURS = 10_000


class SecAggKeys(Message):
    """Step 1, device: this round's public keys and the commitment to its self-mask seed."""

    kind: Literal["secagg-keys"] = "secagg-keys"
    run_id: RunId
    round_id: NonNegativeInt
    device_id: DeviceId
    channel_key: PublicKey
    mask_key: PublicKey
    seed_commitment: Digest


class RosterEntry(WireModel):
    """One device's keys, as the coordinator relays them to every selected device."""

    device_id: DeviceId
    channel_key: PublicKey
    mask_key: PublicKey


class SecAggRoster(Message):
    """Step 2, coordinator: who advertised keys (U1), and the seed that places them on a ring."""

    kind: Literal["secagg-roster"] = "secagg-roster"
    run_id: RunId
    round_id: NonNegativeInt
    graph_seed: Digest
    devices: tuple[RosterEntry, ...] = Field(max_length=MAX_PEERS)


class SealedShares(WireModel):
    """What a dealer sends one holder: the sealed shares and commitments to each."""

    holder: DeviceId
    sealed: Sealed
    seed_share_commitment: Digest
    key_share_commitment: Digest


class SecAggShares(Message):
    """Step 3, device: its two secrets' shares, sealed for each of its neighbours."""

    kind: Literal["secagg-shares"] = "secagg-shares"
    run_id: RunId
    round_id: NonNegativeInt
    device_id: DeviceId
    shares: tuple[SealedShares, ...] = Field(max_length=MAX_NEIGHBOURS)


class DealtShares(WireModel):
    """One dealer's sealed shares, forwarded to their holder."""

    dealer: DeviceId
    sealed: Sealed


class SecAggInbox(Message):
    """Step 4, coordinator to one device: who dealt (U2) and the shares dealt to it."""

    kind: Literal["secagg-inbox"] = "secagg-inbox"
    run_id: RunId
    round_id: NonNegativeInt
    dealers: tuple[DeviceId, ...] = Field(max_length=MAX_PEERS)
    shares: tuple[DealtShares, ...] = Field(max_length=MAX_NEIGHBOURS)


class SecAggUnmask(Message):
    """Step 6, coordinator: whose masked input arrived (U3); the other dealers dropped out."""

    kind: Literal["secagg-unmask"] = "secagg-unmask"
    run_id: RunId
    round_id: NonNegativeInt
    survivors: tuple[DeviceId, ...] = Field(max_length=MAX_PEERS)


class RevealedShare(WireModel):
    """One share a holder reveals: of a survivor's seed, or of a dropped device's mask key."""

    dealer: DeviceId
    secret: Literal["seed", "key"]
    share: ShareHex
    salt: SaltHex


class SecAggReveal(Message):
    """Step 7, device: the shares the unmasking asks of it, never both of one dealer."""

    kind: Literal["secagg-reveal"] = "secagg-reveal"
    run_id: RunId
    round_id: NonNegativeInt
    device_id: DeviceId
    shares: tuple[RevealedShare, ...] = Field(max_length=MAX_NEIGHBOURS)


AnyMessage = Annotated[
    DeviceHello
    | DeviceStatus
    | CoordinatorStatus
    | FleetStatus
    | FleetSummary
    | FleetRow
    | RunHistory
    | SharedModel
    | ModelDelta
    | RoundAnnouncement
    | PeerRequest
    | PeerModels
    | DeviceUpdate
    | EvaluationReport
    | Command
    | ExportReport
    | SecAggKeys
    | SecAggRoster
    | SecAggShares
    | SecAggInbox
    | SecAggUnmask
    | SecAggReveal,
    Field(discriminator="kind"),
]
MESSAGE_ADAPTER: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)
ALL_MESSAGE_TYPES: tuple[type[Message], ...] = (
    DeviceHello,
    DeviceStatus,
    CoordinatorStatus,
    FleetStatus,
    FleetSummary,
    FleetRow,
    RunHistory,
    SharedModel,
    ModelDelta,
    RoundAnnouncement,
    PeerRequest,
    PeerModels,
    DeviceUpdate,
    EvaluationReport,
    Command,
    ExportReport,
    SecAggKeys,
    SecAggRoster,
    SecAggShares,
    SecAggInbox,
    SecAggUnmask,
    SecAggReveal,
)


def parse_header(raw: bytes | str) -> AnyMessage:
    """Validate a JSON header into its message type.

    Raises:
        ProtocolError: the JSON is malformed, of an unknown kind or version, or breaks a field rule.
    """
    try:
        return MESSAGE_ADAPTER.validate_json(raw)
    except ValidationError as error:
        msg = f"malformed message: {first_problem(error)} ({error.error_count()} problem(s))"
        raise ProtocolError(msg) from None


def first_problem(error: ValidationError) -> str:
    """The first of a validation's problems in one line: the field, then what is wrong."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "message"
    return f"{where}: {first['msg']}"


def dump_header(message: Message) -> bytes:
    """The JSON bytes of a message header."""
    return message.model_dump_json().encode()
