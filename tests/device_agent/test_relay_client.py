"""The device half of the relay: requests name held copies, answers are verified model by model."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch

from device_agent.received import ReceivedFrames, ReceivedModel
from device_agent.relay import RelayClient
from protocols.codec import describe_tensors, join_owners, model_digest, pack_tensors
from protocols.errors import ProtocolError, RoundError
from protocols.messages import PeerModels, RelayedModel, RoundAnnouncement, SharedModel

LAYOUT = {"w": torch.zeros(2, 2)}


class _Asks:
    """An algorithm's device half that always asks for the same owners' models."""

    name: ClassVar[str] = "asks"
    relays: ClassVar[bool] = True

    def __init__(self, owners: tuple[str, ...]) -> None:
        self.owners = owners

    def choose_models(self, ctx: object, phase: Literal["train", "evaluate"]) -> tuple[str, ...]:
        return self.owners


def _client(tmp_path=None) -> RelayClient:
    frames = ReceivedFrames(tmp_path, "d0")
    return RelayClient("d0", describe_tensors(LAYOUT), frames)


def _round(
    round_id: int, phase: Literal["train", "evaluate", "export"] = "train"
) -> tuple[RoundAnnouncement, ReceivedModel]:
    manifest, blob = pack_tensors(LAYOUT)
    announcement = RoundAnnouncement(
        run_id="0" * 32,
        round_id=round_id,
        phase=phase,
        algorithm="federico",
        config={},
        model_sha256="0" * 64,
    )
    return announcement, ReceivedModel(SharedModel(round_id=0, manifest=manifest), blob)


def _answer(
    round_id: int, models: dict[str, dict[str, torch.Tensor]], held: dict[str, str] | None = None
) -> tuple[PeerModels, bytes]:
    manifest, blob = pack_tensors(join_owners(models))
    relayed = [RelayedModel(owner=o, digest=model_digest(m), sent=True) for o, m in models.items()]
    relayed += [RelayedModel(owner=o, digest=d, sent=False) for o, d in (held or {}).items()]
    message = PeerModels(
        round_id=round_id, phase="train", device_id="d0", models=tuple(relayed), manifest=manifest
    )
    return message, blob


def test_models_are_verified_then_held_and_named_as_cached_next_time() -> None:
    client = _client()
    announcement, model = _round(1)
    first = client.request(announcement, model, _Asks(("d0", "d1")), None)  # type: ignore[arg-type]
    assert first.models == ("d0", "d1")
    assert first.cached == {}
    mine, theirs = {"w": torch.ones(2, 2)}, {"w": torch.full((2, 2), 2.0)}
    awaited, _, models = client.receive(*_answer(1, {"d0": mine, "d1": theirs}))
    assert awaited is announcement
    assert torch.equal(models["d1"]["w"], theirs["w"])
    second = client.request(_round(2)[0], model, _Asks(("d0", "d1")), None)  # type: ignore[arg-type]
    assert second.cached == {"d0": model_digest(mine), "d1": model_digest(theirs)}
    # d1 unchanged: the coordinator sends only d0, and the held copy of d1 is used
    _, _, again = client.receive(*_answer(2, {"d0": mine}, held={"d1": model_digest(theirs)}))
    assert torch.equal(again["d1"]["w"], theirs["w"])


def test_relayed_models_without_a_waiting_request_are_refused() -> None:
    client = _client()
    with pytest.raises(RoundError, match="stale or unexpected"):
        client.receive(*_answer(1, {"d0": {"w": torch.ones(2, 2)}}))
    client.request(*_round(2), _Asks(("d0",)), None)  # type: ignore[arg-type]
    with pytest.raises(RoundError, match="stale or unexpected"):
        client.receive(*_answer(1, {"d0": {"w": torch.ones(2, 2)}}))


def test_a_model_that_does_not_match_its_digest_or_a_copy_not_held_is_refused() -> None:
    client = _client()
    client.request(*_round(1), _Asks(("d0", "d1")), None)  # type: ignore[arg-type]
    message, blob = _answer(1, {"d0": {"w": torch.ones(2, 2)}})
    forged = message.model_copy(
        update={"models": (RelayedModel(owner="d0", digest="f" * 64, sent=True),)}
    )
    with pytest.raises(ProtocolError, match="d0 does not match its digest"):
        client.receive(forged, blob)
    client.request(*_round(1), _Asks(("d0", "d1")), None)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="d1 does not match its digest"):
        client.receive(*_answer(1, {"d0": {"w": torch.ones(2, 2)}}, held={"d1": "a" * 64}))


def test_an_evaluation_relay_becomes_the_mixture_kept_for_offline_export(tmp_path) -> None:
    client = _client(tmp_path)
    client.request(*_round(3, "evaluate"), _Asks(("d0",)), None)  # type: ignore[arg-type]
    message, blob = _answer(3, {"d0": {"w": torch.ones(2, 2)}})
    client.receive(message.model_copy(update={"phase": "evaluate"}), blob)
    assert list(client.export_models()) == ["d0"]
    assert (tmp_path / "relayed.safetensors").exists()
