"""The device's egress gate: every field of the protocol classified, what each regime lets out."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from device_agent.egress import (
    COORDINATOR_KINDS,
    EXITS,
    PARTS,
    Egress,
    EgressError,
    Regime,
    Release,
    vet,
)
from protocols import messages
from protocols.codec import decode_frame
from protocols.messages import (
    ALL_MESSAGE_TYPES,
    Capabilities,
    DeviceHello,
    DeviceStatus,
    DeviceUpdate,
    EvaluationReport,
    ExportReport,
    MemoryPlan,
    Message,
    PeerRequest,
    TensorManifest,
    WireModel,
)
from protocols.settings_sections import is_class
from protocols.topics import DeviceTopicKind
from protocols.transport.inprocess import InProcessBroker

RUN = "0" * 32


def _nested_models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models an annotation holds (in unions, tuples, dicts, Annotated)."""
    if is_class(annotation) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for argument in get_args(annotation):
        yield from _nested_models(argument)


def unclassified(
    model: type[BaseModel],
    fields: dict[str, Release],
    parts: dict[type[WireModel], dict[str, Release]],
) -> list[str]:
    """Every field of `model` (and of models nested in its NOT_DATA fields) not classified."""
    missing = [f"{model.__name__}.{name}" for name in model.model_fields if name not in fields]
    missing += [
        f"{model.__name__}.{name} (stale)" for name in fields if name not in model.model_fields
    ]
    for name, info in model.model_fields.items():
        if fields.get(name) is not Release.NOT_DATA:
            continue  # withheld, disclosed or protected as a whole
        for nested in _nested_models(info.annotation):
            if nested not in parts:
                missing.append(f"{model.__name__}.{name}: {nested.__name__}")
            else:
                missing += unclassified(nested, parts[nested], parts)
    return missing


def _union_members() -> tuple[type[Message], ...]:
    union = get_args(messages.AnyMessage)[0]
    return typing.get_args(union) if not isinstance(union, types.UnionType) else get_args(union)


def test_every_message_kind_is_a_device_exit_or_the_coordinators() -> None:
    kinds = {
        model.model_fields["kind"].default for model in (*ALL_MESSAGE_TYPES, *_union_members())
    }
    device_kinds = {model.model_fields["kind"].default for model in EXITS}
    assert device_kinds.isdisjoint(COORDINATOR_KINDS)
    assert kinds == device_kinds | COORDINATOR_KINDS


EXIT_MODELS: list[type[Message]] = sorted(EXITS, key=lambda m: m.__name__)


@pytest.mark.parametrize("model", EXIT_MODELS, ids=lambda m: m.__name__)
def test_every_field_a_device_sends_is_classified(model: type[Message]) -> None:
    assert unclassified(model, EXITS[model].fields, PARTS) == []


def test_a_field_added_later_is_caught_by_the_walk_and_refused_by_the_gate() -> None:
    # Prepare: a status and a capability, each with a field nobody classified
    class ChattyStatus(DeviceStatus):
        battery_percent: int = 40

    class ChattyCapabilities(Capabilities):
        owner: str = "x"

    class ChattyHello(DeviceHello):
        capabilities: ChattyCapabilities

    # Execute / Assert: the walk names them; the gate refuses a message with such a field
    assert unclassified(ChattyStatus, EXITS[DeviceStatus].fields, PARTS) == [
        "ChattyStatus.battery_percent"
    ]
    assert unclassified(ChattyHello, EXITS[DeviceHello].fields, PARTS) == [
        "ChattyHello.capabilities: ChattyCapabilities"
    ]
    EXITS[ChattyStatus] = EXITS[DeviceStatus]
    try:
        with pytest.raises(EgressError, match="battery_percent"):
            vet(ChattyStatus(device_id="dev-a", state="online"), Regime())
    finally:
        del EXITS[ChattyStatus]


def test_a_coordinator_kind_never_leaves_a_device() -> None:
    announcement = messages.CoordinatorStatus(state="online", fleet="default")
    with pytest.raises(EgressError, match="does not send coordinator-status"):
        vet(announcement, Regime())


def _update() -> DeviceUpdate:
    return DeviceUpdate(
        run_id=RUN,
        round_id=3,
        device_id="dev-a",
        algorithm="fedavg",
        num_samples=315,
        train_loss=1.91134,
        scalars={"sigma": 0.2},
        within_clip=0.7,
        manifest=TensorManifest(),
    )


def test_withheld_fields_get_their_stand_ins_under_dp_or_secure_aggregation() -> None:
    update = _update()
    plain, private = vet(update, Regime()), vet(update, Regime(private=True))
    assert plain is update
    assert isinstance(private, DeviceUpdate)
    assert (private.num_samples, private.train_loss, private.scalars) == (1, 0.0, {})
    assert private.within_clip == 0.7  # the mechanism's noised bit
    status = DeviceStatus(device_id="dev-a", state="skipped", last_loss=1.91134, detail="busy")
    vetted = vet(status, Regime(private=True))
    assert isinstance(vetted, DeviceStatus)
    assert (vetted.last_loss, vetted.detail) == (None, "busy")
    request = PeerRequest(run_id=RUN, round_id=1, phase="train", device_id="d", models=("e",))
    assert vet(request, Regime(private=True)) is None  # which peers reveals the losses


def device_hello(device_id: str, samples: int) -> DeviceHello:
    """A hello declaring `samples` training samples, on a made-up machine."""
    return DeviceHello(
        device_id=device_id,
        task="digits",
        num_train_samples=samples,
        capabilities=Capabilities(
            cores=2, memory_bytes=1, arch="x", torch_version="2", python_version="3"
        ),
    )


def test_strict_mode_releases_nothing_outside_the_guarantee() -> None:
    strict = Regime(private=True, strict=True)
    plan = MemoryPlan(
        budget_bytes=2**28, estimated_peak_bytes=2**27, micro_batch_size=8, accumulation_steps=4
    )
    hello = device_hello("dev-a", 315).model_copy(update={"memory_plan": plan})
    assert vet(hello, Regime(private=True)) == hello  # disclosed by default (documented)
    vetted = vet(hello, strict)
    assert isinstance(vetted, DeviceHello)
    assert (vetted.num_train_samples, vetted.memory_plan) == (1, None)
    report = EvaluationReport(
        run_id=RUN,
        round_id=2,
        device_id="dev-a",
        metric_name="accuracy",
        personalized=0.93,
        num_test_samples=40,
        num_train_samples=315,
    )
    assert vet(report, strict) is None
    export = ExportReport(
        round_id=2, device_id="dev-a", ok=True, sha256="ab", metrics={"accuracy": 0.9}
    )
    sent = vet(export, strict)
    assert isinstance(sent, ExportReport)
    assert (sent.ok, sent.sha256, sent.metrics) == (True, "", {})


def _train(privacy: bool) -> messages.RoundAnnouncement:
    return messages.RoundAnnouncement(
        run_id=RUN,
        round_id=1,
        phase="train",
        algorithm="fedavg",
        model_sha256="0" * 64,
        privacy=messages.DevicePrivacy(clip_norm=1.0) if privacy else None,
    )


def test_a_status_stays_private_while_the_loss_held_came_from_a_private_round() -> None:
    # Prepare: a gate on a hub, a spy on the device's status topic
    broker = InProcessBroker()
    seen: list[DeviceStatus] = []

    def spy(topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        assert isinstance(message, DeviceStatus)
        seen.append(message)

    broker.connect("spy").subscribe("pfl/default/device/dev-a/status", spy)
    gate = Egress(broker.connect("dev-a"), "default", "dev-a")
    status = DeviceStatus(device_id="dev-a", state="online", last_loss=1.25)

    # Execute: a status before any round, after a private update, after a plain one
    gate.send(status)
    gate.send(_update(), answering=_train(privacy=True))
    gate.send(status)
    gate.send(_update(), answering=_train(privacy=False))
    gate.send(status)
    broker.pump(lambda: False)

    # Assert
    assert [s.last_loss for s in seen] == [1.25, None, 1.25]


def test_strict_mode_declines_plain_training_and_every_evaluation() -> None:
    gate = Egress(InProcessBroker().connect("dev-a"), "default", "dev-a", strict=True)
    evaluation = _train(privacy=True).model_copy(update={"phase": "evaluate", "privacy": None})
    assert gate.refusal(_train(privacy=True)) is None
    assert "only under differential privacy" in (gate.refusal(_train(privacy=False)) or "")
    assert "held-out metrics" in (gate.refusal(evaluation) or "")
    lenient = Egress(InProcessBroker().connect("dev-a"), "default", "dev-a")
    assert lenient.refusal(_train(privacy=False)) is None
    assert lenient.refusal(evaluation) is None


def test_every_stand_in_is_for_a_field_that_can_be_withheld() -> None:
    for model, exit_ in EXITS.items():
        for name in exit_.neutral:
            assert exit_.fields[name] in (Release.WITHHELD, Release.DISCLOSED), (model, name)
        assert exit_.topic in get_args(DeviceTopicKind)
