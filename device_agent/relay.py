"""The device half of the relay (FedeRiCo): ask for peers' models, verify them, keep them.

A relay algorithm's round cannot start on the broadcast model alone: the device first names the
models it needs (`RelayClient.request`), the coordinator answers on the device's relay topic, and
the round runs once `RelayClient.receive` has verified every model against its digest. The models
of the last evaluation are the mixture an export ships. For every other algorithm the client
asks for nothing, and `deployable` is the algorithm's own personalized model.
"""

from __future__ import annotations

from torch import nn

from device_agent.algorithms.base import LocalContext, LocalUpdate, is_relay, relay_update
from device_agent.received import ReceivedFrames, ReceivedModel
from protocols.codec import Tensors, model_digest, split_owners, unpack_tensors
from protocols.errors import ProtocolError, RoundError
from protocols.messages import PeerModels, PeerRequest, RoundAnnouncement, TensorSpec


def relay_mixture(update: LocalUpdate, ctx: LocalContext) -> nn.Module | None:
    """A relay algorithm's deployable mixture of `ctx.peer_models`; None for other algorithms."""
    return relay_update(update).deployable(ctx) if is_relay(update) else None


def deployable(update: LocalUpdate, ctx: LocalContext) -> nn.Module:
    """The module this device would deploy: a relay's mixture, else `ctx.model` personalized."""
    mixture = relay_mixture(update, ctx)
    if mixture is not None:
        return mixture
    update.personalize(ctx)
    return ctx.model


def has_global_model(update: LocalUpdate, ctx: LocalContext) -> bool:
    """Whether a fleet-wide model exists to compare with (a relay keeps one model per device)."""
    return bool(ctx.split.shared) and not is_relay(update)


class RelayClient:
    """One device's relayed models: those last received, and the mixture an export uses."""

    def __init__(self, device_id: str, layout: tuple[TensorSpec, ...], frames: ReceivedFrames):
        self.device_id = device_id
        self.layout = layout
        self.frames = frames
        self.relayed: dict[str, tuple[str, Tensors]] = {}
        """The models last relayed to this device, by owner: (digest, tensors)."""
        self.mixture: dict[str, Tensors] = {}
        """The models of the last evaluation relay: what an export mixes."""
        self._awaiting: tuple[RoundAnnouncement, ReceivedModel] | None = None

    def wants_models(self, update: LocalUpdate) -> bool:
        """Whether `update` needs models relayed before it can run."""
        return is_relay(update)

    def request(
        self,
        announcement: RoundAnnouncement,
        model: ReceivedModel,
        update: LocalUpdate,
        ctx: LocalContext,
    ) -> PeerRequest:
        """The request for this round's models, naming the copies already held."""
        phase = announcement.phase
        if phase not in ("train", "evaluate"):
            msg = f"a {phase} round relays no models"
            raise RoundError(msg, device_id=self.device_id, round_id=announcement.round_id)
        wanted = relay_update(update).choose_models(ctx, phase)
        self._awaiting = (announcement, model)
        return PeerRequest(
            run_id=announcement.run_id,
            round_id=announcement.round_id,
            phase=phase,
            device_id=self.device_id,
            models=wanted,
            cached={o: held[0] for o, held in self.relayed.items() if o in wanted},
        )

    def receive(
        self, message: PeerModels, blob: bytes
    ) -> tuple[RoundAnnouncement, ReceivedModel, dict[str, Tensors]]:
        """The awaited round, its model and the verified relayed models, now held.

        Raises:
            RoundError: no request of this round and phase is waiting.
            ProtocolError: a malformed frame or a model that does not match its digest.
        """
        awaiting = self._awaiting
        if awaiting is None or (awaiting[0].round_id, awaiting[0].phase) != (
            message.round_id,
            message.phase,
        ):
            msg = "stale or unexpected relayed models"
            raise RoundError(msg, device_id=self.device_id, round_id=message.round_id)
        self._awaiting = None
        models = self._verified_models(message, blob)
        self.relayed = {item.owner: (item.digest, models[item.owner]) for item in message.models}
        if message.phase == "evaluate":
            self.mixture = dict(models)
            self.frames.remember_relayed(models)
        return awaiting[0], awaiting[1], models

    def export_models(self) -> dict[str, Tensors]:
        """The models an export mixes: the last evaluation's, else the last relayed."""
        return self.mixture or {owner: held[1] for owner, held in self.relayed.items()}

    def export_round(
        self, update: LocalUpdate, announcement: RoundAnnouncement, model: ReceivedModel
    ) -> int:
        """The round an export stems from: the latest round that used the held model.

        A device does not download a model it holds, so an unchanged model (a relay's template,
        a fleet whose shared part does not change) keeps the round it was first published in;
        the announcement that used it says how far training went.
        """
        if is_relay(update):
            return announcement.round_id
        return latest_round(model, announcement)

    def _verified_models(self, message: PeerModels, blob: bytes) -> dict[str, Tensors]:
        """Decode the sent models and take the unchanged ones from the held copies, all verified.

        Raises:
            ProtocolError: a malformed frame, a model that does not match its digest, or a
                cached copy the device does not hold.
        """
        sent = [item.owner for item in message.models if item.sent]
        expected = tuple(
            spec.model_copy(update={"name": f"{owner}/{spec.name}"})
            for owner in sent
            for spec in self.layout
        )
        received = split_owners(unpack_tensors(message.manifest, blob, expected=expected))
        models: dict[str, Tensors] = {}
        for item in message.models:
            if item.sent:  # verified here; a cached copy was verified when it arrived
                model = received.get(item.owner, {})
                digest = model_digest(model) if model else ""
            else:
                digest, model = self.relayed.get(item.owner, ("", {}))
            if not model or digest != item.digest:
                msg = f"the relayed model of {item.owner} does not match its digest"
                raise ProtocolError(msg, device_id=self.device_id, round_id=message.round_id)
            models[item.owner] = model
        return models


def latest_round(model: ReceivedModel, announcement: RoundAnnouncement | None) -> int:
    """The round of `model`, or of `announcement` if that is later and used the same model."""
    held = model.header.round_id
    if announcement is not None and announcement.model_sha256 == model.header.manifest.sha256:
        return max(held, announcement.round_id)
    return held
