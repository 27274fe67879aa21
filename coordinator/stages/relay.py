"""The engine's seam for strategies that relay per-device models (FedeRiCo).

The round engine asks its relay hook four things: which peers to announce, whether the model
must be re-sent after each round, what layout a device's update must have, and how to answer a
`PeerRequest`. Ordinary strategies get `NoRelay`, a null object with the answers of a fleet that
shares one model, so the engine holds no algorithm branches; a strategy whose config declares
that it relays models (`Capabilities.relays_models`) gets `ModelRelay`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from coordinator.strategies.base import (
    FleetSnapshot,
    ModelBuilder,
    RelayStrategy,
    Strategy,
    relaying,
)
from protocols.codec import Tensors, encode_frame, pack_tensors
from protocols.errors import ProtocolError, RoundError
from protocols.messages import PeerModels, PeerRequest, TensorSpec


class RelayHook(Protocol):
    """What the engine needs from a strategy's relay, if it has one."""

    @property
    def resends_model(self) -> bool:
        """Whether the fleet model changes each round (a relay's template does not)."""
        ...

    def peers(self, fleet: FleetSnapshot) -> tuple[str, ...]:
        """The owners a round's announcement lists as candidates."""
        ...

    def start_round(self, round_id: int) -> None:
        """Forget what earlier rounds promised (a retried round keeps its own promises)."""
        ...

    def update_layout(
        self, round_id: int, device_id: str, shared: tuple[TensorSpec, ...]
    ) -> tuple[TensorSpec, ...]:
        """The layout a device's update must have.

        Raises:
            RoundError: the device sends an update before it was relayed its models.
        """
        ...

    def answer(self, request: PeerRequest) -> bytes:
        """The encoded `PeerModels` frame answering `request`.

        Raises:
            ProtocolError: the strategy relays nothing.
            RoundError: the request breaks the algorithm's rules.
        """
        ...

    def state_tensors(self) -> Tensors:
        """The tensors a checkpoint must hold beyond the model (empty without a relay)."""
        ...

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore from `state_tensors()`'s output."""
        ...


class NoRelay:
    """The relay of a strategy that shares one model: announces no peers, answers no request."""

    def __init__(self, strategy_name: str) -> None:
        self._name = strategy_name

    @property
    def resends_model(self) -> bool:
        """See `RelayHook.resends_model`."""
        return True

    def peers(self, fleet: FleetSnapshot) -> tuple[str, ...]:
        """See `RelayHook.peers`."""
        return ()

    def start_round(self, round_id: int) -> None:
        """See `RelayHook.start_round`."""

    def update_layout(
        self, round_id: int, device_id: str, shared: tuple[TensorSpec, ...]
    ) -> tuple[TensorSpec, ...]:
        """See `RelayHook.update_layout`."""
        return shared

    def answer(self, request: PeerRequest) -> bytes:
        """See `RelayHook.answer`."""
        msg = f"{self._name} relays no models"
        raise ProtocolError(msg, device_id=request.device_id)

    def state_tensors(self) -> Tensors:
        """See `RelayHook.state_tensors`."""
        return {}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """See `RelayHook.load_state_tensors`."""


class ModelRelay:
    """Relays a `RelayStrategy`'s models and holds each device to the layout it was promised."""

    def __init__(self, strategy: RelayStrategy) -> None:
        self._strategy = strategy
        self._layouts: dict[tuple[int, str], tuple[TensorSpec, ...]] = {}

    @property
    def resends_model(self) -> bool:
        """See `RelayHook.resends_model`."""
        return False  # the models live in the strategy; the broadcast template never changes

    def peers(self, fleet: FleetSnapshot) -> tuple[str, ...]:
        """See `RelayHook.peers`."""
        return self._strategy.candidates(fleet)

    def start_round(self, round_id: int) -> None:
        """See `RelayHook.start_round`."""
        # a retried round keeps its layouts: devices re-send the answer to their earlier relay
        self._layouts = {k: v for k, v in self._layouts.items() if k[0] == round_id}

    def update_layout(
        self, round_id: int, device_id: str, shared: tuple[TensorSpec, ...]
    ) -> tuple[TensorSpec, ...]:
        """See `RelayHook.update_layout`."""
        layout = self._layouts.get((round_id, device_id))
        if layout is None:
            msg = "update before its relayed models"
            raise RoundError(msg, device_id=device_id, round_id=round_id)
        return layout

    def answer(self, request: PeerRequest) -> bytes:
        """See `RelayHook.answer`."""
        relay = self._strategy.relay(request.round_id, request)
        if request.phase == "train":
            self._layouts[(request.round_id, request.device_id)] = relay.expected
        manifest, blob = pack_tensors(relay.tensors)
        models = PeerModels(
            round_id=request.round_id,
            phase=request.phase,
            device_id=request.device_id,
            models=relay.models,
            missing=relay.missing,
            manifest=manifest,
        )
        return encode_frame(models, blob)

    def state_tensors(self) -> Tensors:
        """See `RelayHook.state_tensors`."""
        return self._strategy.state_tensors()

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """See `RelayHook.load_state_tensors`."""
        self._strategy.load_state_tensors(tensors)


def relay_for(
    strategy: Strategy, model: Tensors, build_model: ModelBuilder | None, seed: int
) -> RelayHook:
    """The hook for `strategy`; a relay strategy first learns the model and how to start one.

    Raises:
        TypeError: the config declares relayed models and the strategy cannot relay them.
    """
    relay = relaying(strategy)
    if relay is None:
        return NoRelay(strategy.name)
    relay.bind(model, build_model, seed)
    return ModelRelay(relay)
