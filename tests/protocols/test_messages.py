"""Tests for the message models: round trips, strictness, field rules and immutability."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from protocols.errors import ProtocolError
from protocols.messages import (
    ALL_MESSAGE_TYPES,
    Capabilities,
    Command,
    Compression,
    CoordinatorStatus,
    DealtShares,
    DeviceAssignment,
    DeviceHello,
    DeviceResult,
    DeviceStatus,
    DeviceUpdate,
    EvaluationReport,
    ExportArguments,
    ExportReport,
    FleetDevice,
    FleetRow,
    FleetStatus,
    FleetSummary,
    MemoryPlan,
    Message,
    ModelDelta,
    PeerModels,
    PeerRequest,
    RelayedModel,
    RevealedShare,
    RosterEntry,
    RoundAnnouncement,
    RoundSummary,
    RunHistory,
    SealedShares,
    SecAggInbox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    SharedModel,
    TensorManifest,
    TensorSpec,
    dump_header,
    parse_header,
)

MODEL_SHA256 = "ab" * 32
MANIFEST = TensorManifest(
    tensors=(
        TensorSpec(name="layer.weight", dtype="float32", shape=(4, 3)),
        TensorSpec(name="layer.bias", dtype="bfloat16", shape=(4,)),
        TensorSpec(name="steps", dtype="int64", shape=()),
    ),
    byte_length=120,
    sha256="cd" * 32,
)
HELLO = DeviceHello(
    device_id="jetson-7",
    task="sine",
    num_train_samples=320,
    capabilities=Capabilities(
        cores=6,
        memory_bytes=8 << 30,
        arch="aarch64",
        torch_version="2.13.0",
        python_version="3.10.12",
    ),
    memory_plan=MemoryPlan(
        budget_bytes=1 << 30,
        estimated_peak_bytes=700 << 20,
        micro_batch_size=16,
        accumulation_steps=4,
        method="probe",
    ),
    stateful=False,
)
STATUS = DeviceStatus(
    device_id="pi-3", state="training", round_id=5, last_loss=0.75, detail="epoch 2"
)
COORDINATOR = CoordinatorStatus(
    state="running", fleet="lab", task="sine", algorithm="selffl", round_id=5, rounds=40
)
FLEET = FleetStatus(
    fleet="lab",
    round_id=5,
    devices=(
        FleetDevice(
            device_id="pi-3",
            online=True,
            last_seen=1.0,
            round_id=5,
            last_loss=0.5,
            num_train_samples=97,
        ),
    ),
)
SUMMARY = FleetSummary(
    fleet="lab", epoch="0a1b", round_id=5, registered=1, online=1, broadcast_bytes=10
)
ROW = FleetRow(fleet="lab", epoch="0a1b", device=FLEET.devices[0], broadcast_mark=4)
HISTORY = RunHistory(
    fleet="lab",
    run_id="0123456789abcdef" * 2,
    settings={"task": "digits", "rounds": 10.0, "secagg": False, "personal": None},
    rounds=(
        RoundSummary(
            round_id=5, selected=3, participants=2, skipped=1, dropped=4, train_loss=0.5,
            evaluation={"personalized_mean": 0.8, "global": None},
        ),
    ),
    devices=(
        DeviceResult(
            device_id="pi-3", round_id=5, metric_name="accuracy", personalized=0.9,
            global_model=0.7, num_train_samples=97,
        ),
    ),
)  # fmt: skip
MODEL = SharedModel(round_id=5, manifest=MANIFEST)
DELTA = ModelDelta(round_id=5, base_sha256="ab" * 32, target_sha256=MODEL_SHA256, manifest=MANIFEST)
RUN = "0123456789abcdef" * 2
ROUND = RoundAnnouncement(
    run_id=RUN,
    round_id=5,
    phase="train",
    algorithm="selffl",
    config={"local_epochs": 2, "lr": 0.05},
    model_sha256=MODEL_SHA256,
    deadline_s=30.0,
    assignments={"pi-3": DeviceAssignment(scalars={"sigma0_sq": 0.5})},
    uplink=Compression(codec="int8"),
    delta_base_sha256="ab" * 32,
)
UPDATE = DeviceUpdate(
    run_id=RUN,
    round_id=5,
    device_id="pi-3",
    algorithm="selffl",
    num_samples=97,
    train_loss=0.31,
    scalars={"sigma_m_sq": 0.02},
    compression=Compression(codec="int8"),
    manifest=MANIFEST,
)
EVALUATION = EvaluationReport(
    run_id=RUN,
    round_id=5,
    device_id="pi-3",
    metric_name="mse",
    personalized=0.1,
    global_model=0.4,
    num_test_samples=50,
    num_train_samples=97,
)
COMMAND = Command(action="export", round_id=5, export=ExportArguments(quantize="int8", guard=True))
EXPORT = ExportReport(
    round_id=5,
    device_id="pi-3",
    ok=True,
    path="/var/lib/pfl/model.onnx",
    size_bytes=4096,
    sha256="ef" * 32,
    parity_max_abs_diff=1e-7,
    metrics={"latency_ms": 0.8},
)
REQUEST = PeerRequest(
    run_id=RUN,
    round_id=5,
    phase="train",
    device_id="pi-3",
    models=("pi-3", "pi-7"),
    cached={"pi-7": "ab" * 32},
)
RELAY = PeerModels(
    round_id=5,
    phase="train",
    device_id="pi-3",
    models=(
        RelayedModel(owner="pi-3", digest="cd" * 32, sent=True),
        RelayedModel(owner="pi-7", digest="ab" * 32, sent=False),
    ),
    missing=("pi-9",),
    manifest=MANIFEST,
)
KEY = "ab" * 32
SECAGG = (
    SecAggKeys(
        run_id=RUN, round_id=5, device_id="pi-3", channel_key=KEY, mask_key=KEY,
        seed_commitment="cd" * 32,
    ),
    SecAggRoster(
        run_id=RUN, round_id=5, graph_seed="ef" * 32,
        devices=(RosterEntry(device_id="pi-3", channel_key=KEY, mask_key=KEY),),
    ),
    SecAggShares(
        run_id=RUN, round_id=5, device_id="pi-3",
        shares=(SealedShares(holder="pi-4", sealed="00" * 192, seed_share_commitment="cd" * 32,
                             key_share_commitment="ef" * 32),),
    ),
    SecAggInbox(
        run_id=RUN, round_id=5, dealers=("pi-3", "pi-4"),
        shares=(DealtShares(dealer="pi-4", sealed="00" * 192),),
    ),
    SecAggUnmask(run_id=RUN, round_id=5, survivors=("pi-3", "pi-4", "pi-5")),
    SecAggReveal(
        run_id=RUN, round_id=5, device_id="pi-3",
        shares=(RevealedShare(dealer="pi-4", secret="seed", share="01" * 66, salt="02" * 16),),
    ),
)  # fmt: skip
EXAMPLES: tuple[Message, ...] = (
    HELLO,
    STATUS,
    COORDINATOR,
    FLEET,
    SUMMARY,
    ROW,
    HISTORY,
    MODEL,
    DELTA,
    ROUND,
    REQUEST,
    RELAY,
    UPDATE,
    EVALUATION,
    COMMAND,
    EXPORT,
    *SECAGG,
)
BY_KIND: dict[str, Message] = {type(m).model_fields["kind"].default: m for m in EXAMPLES}
WITH_DEVICE_ID = [message for message in EXAMPLES if "device_id" in type(message).model_fields]


def fields_of(message: Message) -> dict[str, Any]:
    fields: dict[str, Any] = json.loads(dump_header(message))
    return fields


def test_examples_cover_every_message_type() -> None:
    # Assert
    assert {type(message) for message in EXAMPLES} == set(ALL_MESSAGE_TYPES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_every_message_round_trips_through_its_header(message: Message) -> None:
    # Execute
    parsed = parse_header(dump_header(message))

    # Assert
    assert type(parsed) is type(message)
    assert parsed == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_unknown_top_level_fields_are_rejected(message: Message) -> None:
    # Prepare
    fields = fields_of(message) | {"personal_weights": [1.0, 2.0]}

    # Execute / Assert
    with pytest.raises(ProtocolError, match="personal_weights: Extra inputs are not permitted"):
        parse_header(json.dumps(fields))


def test_unknown_nested_fields_are_rejected() -> None:
    # Prepare
    fields = fields_of(UPDATE)
    fields["manifest"]["tensors"][0]["raw_data"] = "AAAA"

    # Execute / Assert
    with pytest.raises(ProtocolError, match="raw_data: Extra inputs are not permitted"):
        parse_header(json.dumps(fields))


@pytest.mark.parametrize(
    "device_id",
    ["", "a/b", "pi+3", "pi#", "#", "+", "x" * 65, "-leading", ".hidden", "has space", "ü"],
)
@pytest.mark.parametrize("message", WITH_DEVICE_ID, ids=lambda message: type(message).__name__)
def test_invalid_device_ids_are_rejected(message: Message, device_id: str) -> None:
    # Prepare
    fields = fields_of(message) | {"device_id": device_id}

    # Execute / Assert
    with pytest.raises(ProtocolError, match="device_id"):
        parse_header(json.dumps(fields))


@pytest.mark.parametrize("device_id", ["a", "pi-3", "jetson_7.lab", "x" * 64])
def test_valid_device_ids_are_accepted(device_id: str) -> None:
    # Execute
    status = DeviceStatus(device_id=device_id, state="online")

    # Assert
    assert parse_header(dump_header(status)) == status


def test_invalid_device_id_in_assignments_is_rejected() -> None:
    # Prepare
    fields = fields_of(ROUND)
    fields["assignments"] = {"pi/3": {"scalars": {}}}

    # Execute / Assert
    with pytest.raises(ProtocolError, match="assignments"):
        parse_header(json.dumps(fields))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("update", ("train_loss",)),
        ("update", ("scalars", "sigma_m_sq")),
        ("evaluation", ("personalized",)),
        ("evaluation", ("global_model",)),
        ("status", ("last_loss",)),
        ("export-report", ("parity_max_abs_diff",)),
        ("export-report", ("metrics", "latency_ms")),
        ("round", ("assignments", "pi-3", "scalars", "sigma0_sq")),
    ],
)
def test_non_finite_floats_are_rejected(kind: str, path: tuple[str, ...], literal: str) -> None:
    # Prepare: JSON has no NaN, but lenient encoders write these literals anyway
    fields = fields_of(BY_KIND[kind])
    target = fields
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "__NON_FINITE__"
    raw = json.dumps(fields).replace('"__NON_FINITE__"', literal)

    # Execute / Assert
    with pytest.raises(ProtocolError, match="expected a finite number"):
        parse_header(raw)


def test_non_finite_floats_are_rejected_when_built_in_code() -> None:
    # Execute / Assert
    with pytest.raises(ValidationError, match="expected a finite number"):
        DeviceUpdate(
            run_id=RUN,
            round_id=1,
            device_id="pi-3",
            algorithm="fedavg",
            num_samples=3,
            train_loss=float("nan"),
            manifest=MANIFEST,
        )


@pytest.mark.parametrize(
    ("kind", "field", "value", "complaint"),
    [
        ("update", "round_id", -1, "round_id"),
        ("update", "num_samples", -5, "num_samples"),
        ("round", "model_sha256", "not-a-digest", "model_sha256"),
        ("round", "run_id", "../../etc", "run_id"),
        ("update", "run_id", "A" * 32, "run_id"),
        ("evaluation", "run_id", "", "run_id"),
        ("round", "deadline_s", 0, "deadline_s"),
        ("status", "state", "sleeping", "state"),
        ("command", "action", "format-disk", "action"),
        ("update", "protocol_version", 1, "unsupported protocol version 1"),
        ("update", "kind", "gossip", "kind"),
    ],
)
def test_field_rules_are_enforced(kind: str, field: str, value: object, complaint: str) -> None:
    # Prepare
    fields = fields_of(BY_KIND[kind]) | {field: value}

    # Execute / Assert
    with pytest.raises(ProtocolError, match=complaint):
        parse_header(json.dumps(fields))


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ({"name": "", "dtype": "float32", "shape": [1]}, "name"),
        ({"name": "w", "dtype": "complex64", "shape": [1]}, "dtype"),
        ({"name": "w", "dtype": "float32", "shape": [-1]}, "shape"),
    ],
)
def test_manifest_entries_are_validated(spec: dict[str, object], complaint: str) -> None:
    # Prepare
    fields = fields_of(MODEL)
    fields["manifest"]["tensors"] = [spec]

    # Execute / Assert
    with pytest.raises(ProtocolError, match=complaint):
        parse_header(json.dumps(fields))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_messages_are_frozen(message: Message) -> None:
    # Execute / Assert
    with pytest.raises(ValidationError, match="frozen"):
        message.sent_at = 0.0  # type: ignore[misc]  # the write the test expects refused


def test_nested_models_are_frozen() -> None:
    # Execute / Assert
    with pytest.raises(ValidationError, match="frozen"):
        MANIFEST.byte_length = 0  # type: ignore[misc]  # refused, as above
    with pytest.raises(ValidationError, match="frozen"):
        MANIFEST.tensors[0].shape = (1,)  # type: ignore[misc]  # refused, as above


def test_sent_at_defaults_to_the_send_time() -> None:
    # Execute
    first = DeviceStatus(device_id="pi-3", state="online")
    second = DeviceStatus(device_id="pi-3", state="online")

    # Assert
    assert first.sent_at > 1.6e9
    assert second.sent_at >= first.sent_at


def test_round_addresses_only_assigned_devices_unless_none_are() -> None:
    # Prepare
    everyone = ROUND.model_copy(update={"assignments": {}})

    selected = ROUND.model_copy(update={"assignments": {}, "selected": ("pi-5",)})

    # Execute / Assert
    assert ROUND.addresses("pi-3")
    assert not ROUND.addresses("pi-4")
    assert everyone.addresses("pi-4")
    assert selected.addresses("pi-5")  # selected without scalars
    assert not selected.addresses("pi-3")


def test_a_peer_request_names_each_owner_once() -> None:
    with pytest.raises(ValidationError, match="must not repeat"):
        PeerRequest(
            run_id=RUN, round_id=1, phase="train", device_id="pi-3", models=("pi-3", "pi-7", "pi-7")
        )
    with pytest.raises(ValidationError, match="at least 1"):
        PeerRequest(run_id=RUN, round_id=1, phase="evaluate", device_id="pi-3", models=())


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"metric_name": "accuracy", "personalized": 1e30}, "accuracy 1e\\+30 is outside"),
        ({"metric_name": "accuracy", "personalized": 1.01}, "accuracy 1.01 is outside"),
        ({"metric_name": "accuracy", "personalized": 0.5, "global_model": -0.1}, "outside"),
        ({"metric_name": "mse", "personalized": -0.5}, "mse -0.5 is outside"),
    ],
)
def test_an_evaluation_outside_its_metric_range_is_refused(
    changes: dict[str, object], complaint: str
) -> None:
    # Prepare
    fields = fields_of(EVALUATION) | changes

    # Execute / Assert
    with pytest.raises(ProtocolError, match=complaint):
        parse_header(json.dumps(fields))


@pytest.mark.parametrize(
    "changes",
    [
        {"metric_name": "accuracy", "personalized": 0.0, "global_model": 1.0},
        {"metric_name": "mse", "personalized": 0.0, "global_model": 1e6},
    ],
)
def test_an_evaluation_at_the_ends_of_its_metric_range_is_accepted(
    changes: dict[str, object],
) -> None:
    fields = fields_of(EVALUATION) | changes
    assert parse_header(json.dumps(fields)) == EVALUATION.model_copy(update=changes)
