"""The engine's relay seam: a null relay for shared-model strategies, layouts held per round."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from coordinator.stages.relay import ModelRelay, NoRelay, relay_for
from coordinator.strategies import STRATEGIES
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, RelayStrategy, Strategy
from coordinator.strategies.fedavg import FedAvgStrategy
from coordinator.strategies.federico import FedericoStrategy
from protocols.algorithms import FedAvgConfig, FedericoConfig
from protocols.capabilities import Capabilities
from protocols.codec import decode_frame, describe_tensors
from protocols.errors import ProtocolError, RoundError
from protocols.messages import PeerModels, PeerRequest

RUN = "0" * 32
MODEL = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
FLEET = FleetSnapshot(tuple(DeviceInfo(d, 10, True) for d in ("d0", "d1", "d2")))


def _request(round_id: int, device: str, models: tuple[str, ...]) -> PeerRequest:
    return PeerRequest(
        run_id=RUN, round_id=round_id, phase="train", device_id=device, models=models
    )


def _federico_relay() -> ModelRelay:
    strategy = FedericoStrategy(FedericoConfig(neighbours=1), participation=1.0)
    relay = relay_for(strategy, MODEL, None, seed=3)
    assert isinstance(relay, ModelRelay)
    return relay


def test_a_shared_model_strategy_gets_the_null_relay() -> None:
    relay = relay_for(FedAvgStrategy(FedAvgConfig(), participation=1.0), MODEL, None, seed=0)
    shared = describe_tensors(MODEL)
    assert isinstance(relay, NoRelay)
    assert relay.resends_model
    assert relay.peers(FLEET) == ()
    assert relay.update_layout(1, "d0", shared) == shared
    assert relay.state_tensors() == {}
    with pytest.raises(ProtocolError, match="fedavg relays no models"):
        relay.answer(_request(1, "d0", ("d0",)))


def test_an_update_must_follow_its_relay_and_match_the_promised_layout() -> None:
    relay = _federico_relay()
    shared = describe_tensors(MODEL)
    assert not relay.resends_model
    assert relay.peers(FLEET) == ("d0", "d1", "d2")
    with pytest.raises(RoundError, match="before its relayed models"):
        relay.update_layout(1, "d0", shared)
    message, _ = decode_frame(relay.answer(_request(1, "d0", ("d0", "d1"))))
    assert isinstance(message, PeerModels)
    assert [m.owner for m in message.models] == ["d0", "d1"]
    layout = relay.update_layout(1, "d0", shared)
    assert {spec.name for spec in layout} == {"d0/w", "d0/b", "d1/w", "d1/b"}


def test_a_new_round_forgets_older_promises_but_a_retried_round_keeps_its_own() -> None:
    relay = _federico_relay()
    shared = describe_tensors(MODEL)
    relay.answer(_request(1, "d0", ("d0",)))
    relay.start_round(1)  # the round is retried: d0 may re-send its answer
    assert relay.update_layout(1, "d0", shared)
    relay.start_round(2)
    with pytest.raises(RoundError):
        relay.update_layout(1, "d0", shared)


def test_the_relay_state_round_trips_through_a_checkpoint() -> None:
    relay = _federico_relay()
    relay.answer(_request(1, "d0", ("d0", "d1")))  # the models are created when first relayed
    state = relay.state_tensors()
    assert "model/d0/w" in state
    fresh = _federico_relay()
    fresh.load_state_tensors({k: v + 1 for k, v in state.items()})
    assert all(torch.equal(fresh.state_tensors()[k], v + 1) for k, v in state.items())


@pytest.mark.parametrize("strategy_type", STRATEGIES.values(), ids=lambda s: s.name)
def test_every_strategy_relays_exactly_when_its_config_declares_it(
    strategy_type: type[Strategy],
) -> None:
    strategy = strategy_type(strategy_type.config_type(), participation=1.0)
    declared = strategy.config.capabilities.relays_models
    assert isinstance(strategy, RelayStrategy) == declared
    relay = relay_for(strategy, MODEL, None, seed=0)
    assert isinstance(relay, ModelRelay if declared else NoRelay)


def test_a_declared_relay_without_one_in_the_strategy_is_refused() -> None:
    class Relaying(FedAvgConfig):
        capabilities: ClassVar[Capabilities] = Capabilities(
            aggregation="relay", clear_scalars=None, synchronous="relays"
        )

    strategy = FedAvgStrategy(Relaying(), participation=1.0)
    with pytest.raises(TypeError, match="fedavg declares that it relays models"):
        relay_for(strategy, MODEL, None, seed=0)
