"""FedeRiCo's coordinator half: the relay's rules and caching, per-owner sums, owner Adam."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from coordinator.strategies.federico import FedericoStrategy, OwnerAdam
from protocols.algorithms import FedericoConfig
from protocols.errors import RoundError
from protocols.messages import PeerRequest

RUN = "0" * 32
TEMPLATE = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}


def _build(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2, 3, generator=generator), "b": torch.randn(2, generator=generator)}


def _strategy(**config: Any) -> FedericoStrategy:
    strategy = FedericoStrategy(FedericoConfig(**config), participation=1.0)
    strategy.bind(TEMPLATE, _build, seed=7)
    fleet = FleetSnapshot(tuple(DeviceInfo(d, 10, d != "d3") for d in ("d0", "d1", "d2", "d3")))
    assert strategy.candidates(fleet) == ("d0", "d1", "d2", "d3")  # offline d3 included
    return strategy


def _request(device: str, models: tuple[str, ...], **values: Any) -> PeerRequest:
    return PeerRequest(
        run_id=RUN, round_id=1, phase="train", device_id=device, models=models, **values
    )


def test_relay_sends_the_requested_models_and_promises_their_contribution_layout() -> None:
    strategy = _strategy(neighbours=2)
    relay = strategy.relay(1, _request("d0", ("d0", "d3")))
    assert [m.owner for m in relay.models] == ["d0", "d3"]
    assert all(m.sent for m in relay.models)
    assert set(relay.tensors) == {"d0/w", "d0/b", "d3/w", "d3/b"}
    assert {spec.name for spec in relay.expected} == set(relay.tensors)
    # independent initializations: every owner's model is its own draw
    assert not torch.equal(relay.tensors["d0/w"], relay.tensors["d3/w"])


def test_an_unchanged_cached_model_is_not_resent() -> None:
    strategy = _strategy()
    first = strategy.relay(1, _request("d0", ("d0", "d1")))
    cached = {m.owner: m.digest for m in first.models}
    again = strategy.relay(1, _request("d0", ("d0", "d1"), cached=cached))
    assert [m.sent for m in again.models] == [False, False]
    assert again.tensors == {}
    assert {spec.name for spec in again.expected} == {"d0/w", "d0/b", "d1/w", "d1/b"}


def test_unknown_owners_come_back_missing() -> None:
    strategy = _strategy()
    relay = strategy.relay(1, _request("d0", ("d0", "ghost")))
    assert relay.missing == ("ghost",)
    assert [m.owner for m in relay.models] == ["d0"]


@pytest.mark.parametrize("models", [("d1", "d0"), ("d0", "d1", "d2", "d3")])
def test_training_requests_must_start_with_self_and_respect_m(models: tuple[str, ...]) -> None:
    with pytest.raises(RoundError, match="itself first"):
        _strategy(neighbours=2).relay(1, _request("d0", models))


def test_each_owner_steps_once_with_the_sum_of_its_contributions() -> None:
    # Prepare: d0 and d1 both contribute to d0's model; d1 also to its own
    strategy = _strategy(lr=0.1)
    before = {
        k: v.clone() for k, v in strategy.relay(1, _request("d0", ("d0", "d1"))).tensors.items()
    }
    g0, g1, g2 = (torch.full((2, 3), v) for v in (1.0, 2.0, -1.0))
    b = torch.ones(2)
    updates = [
        ReceivedUpdate("d0", 10, 0.0, {"d0/w": g0, "d0/b": b}),
        ReceivedUpdate("d1", 10, 0.0, {"d0/w": g1, "d0/b": b, "d1/w": g2, "d1/b": b}),
    ]
    # Execute
    aggregate = strategy.aggregate(1, dict(TEMPLATE), updates)
    # Assert: one Adam step on the summed gradient: lr * sign for a first step
    torch.testing.assert_close(strategy.models["d0"]["w"], before["d0/w"] - 0.1)
    torch.testing.assert_close(strategy.models["d1"]["w"], before["d1/w"] + 0.1)
    assert aggregate.scalars["models_updated"] == 2.0
    assert aggregate.scalars["contributions_per_model"] == 1.5
    assert strategy.optimizers["d0"].step == 1
    assert "d2" not in strategy.optimizers


def test_owner_adam_is_torch_adam() -> None:
    config = FedericoConfig(lr=0.03)
    start = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    model, reference = {"w": start.clone()}, torch.nn.Parameter(start.clone())
    optimizer, adam = torch.optim.Adam([reference], lr=0.03), OwnerAdam()
    for step in range(5):
        gradient = torch.randn(4, 3, generator=torch.Generator().manual_seed(step + 1))
        adam.apply(model, {"w": gradient}, config)
        reference.grad = gradient.clone()
        optimizer.step()
    assert torch.equal(model["w"], reference.detach())


def test_delta_mode_adds_the_summed_deltas() -> None:
    strategy = _strategy(mstep="delta")
    before = strategy.relay(1, _request("d0", ("d0",))).tensors["d0/w"].clone()
    delta = torch.full((2, 3), 0.25)
    updates = [ReceivedUpdate(d, 10, 0.0, {"d0/w": delta, "d0/b": torch.zeros(2)}) for d in "ab"]
    strategy.aggregate(1, dict(TEMPLATE), updates)
    torch.testing.assert_close(strategy.models["d0"]["w"], before + 0.5)


def test_checkpoint_state_round_trips_models_moments_and_digests() -> None:
    strategy = _strategy()
    strategy.relay(1, _request("d0", ("d0", "d1")))
    grad = {"d0/w": torch.ones(2, 3), "d0/b": torch.ones(2)}
    strategy.aggregate(1, dict(TEMPLATE), [ReceivedUpdate("d0", 10, 0.0, grad)])
    restored = FedericoStrategy(FedericoConfig(), participation=1.0)
    restored.load_state_dict(strategy.state_dict())
    restored.load_state_tensors(strategy.state_tensors())
    assert restored.digests == strategy.digests
    assert restored.optimizers["d0"].step == 1
    torch.testing.assert_close(restored.optimizers["d0"].second, strategy.optimizers["d0"].second)
    for owner, model in strategy.models.items():
        for name, value in model.items():
            assert torch.equal(restored.models[owner][name], value)
