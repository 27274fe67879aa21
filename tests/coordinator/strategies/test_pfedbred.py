import numpy as np
import pytest
import torch

from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from coordinator.strategies.pfedbred import PFedMeStrategy
from protocols.algorithms import DittoConfig, FedAvgConfig, PFedBreDConfig, PFedMeConfig

from .random_updates import random_updates

SHAPES = {"hidden.weight": (2, 3), "output.bias": (2,)}


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("config_type", [PFedBreDConfig, PFedMeConfig])
def test_aggregate_momentum_matches_the_hand_computed_mix(beta: float, config_type) -> None:
    # Prepare: unequal sample counts, a nonzero global model
    rng = np.random.default_rng(3)
    shared = {
        "hidden.weight": torch.tensor(rng.normal(size=(2, 3)), dtype=torch.float32),
        "output.bias": torch.tensor([1.0, -2.0]),
    }
    counts = [3, 30, 7]
    updates = random_updates(rng, counts, SHAPES)
    strategy = build_strategy(config_type(beta=beta), participation=1.0)
    # Execute
    result = strategy.aggregate(1, shared, updates)
    # Assert: w <- (1 - beta) w + beta * sum_i p_i w_i with w_i = w + Delta_i (spec §2.3)
    for name, value in shared.items():
        w = value.numpy().astype(np.float64)
        locals_ = [w + u.shared_delta[name].numpy() for u in updates]
        w_bar = sum(n * local for n, local in zip(counts, locals_, strict=True)) / sum(counts)
        expected = (1 - beta) * w + beta * w_bar
        np.testing.assert_allclose(result.shared[name].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_beta_one_is_fedavg_and_ditto_aggregates_as_fedavg() -> None:
    rng = np.random.default_rng(4)
    shared = {"hidden.weight": torch.zeros(2, 3), "output.bias": torch.ones(2)}
    updates = random_updates(rng, [4, 9, 2], SHAPES)
    fedavg = build_strategy(FedAvgConfig(), 1.0).aggregate(1, shared, updates)
    for config in (PFedBreDConfig(beta=1.0), PFedMeConfig(), DittoConfig()):
        result = build_strategy(config, 1.0).aggregate(1, shared, updates)
        for name in shared:
            torch.testing.assert_close(result.shared[name], fedavg.shared[name])


def _fleet() -> FleetSnapshot:
    return FleetSnapshot(tuple(DeviceInfo(f"dev-{i}", 10, online=i != 3) for i in range(10)))


def test_train_all_clients_trains_everyone_and_aggregates_the_sample() -> None:
    # Prepare
    strategy = build_strategy(PFedBreDConfig(train_all_clients=True, beta=2.0), 0.2)
    sampled_only = build_strategy(PFedBreDConfig(beta=2.0), 0.2)
    plan = strategy.plan_round(1, _fleet(), np.random.default_rng(0))
    sample = sampled_only.plan_round(1, _fleet(), np.random.default_rng(0)).devices
    rng = np.random.default_rng(5)
    shared = {"hidden.weight": torch.zeros(2, 3), "output.bias": torch.ones(2)}
    updates = [
        ReceivedUpdate(f"dev-{i}", u.num_samples, u.train_loss, u.shared_delta)
        for i, u in zip(
            [d for d in range(10) if d != 3], random_updates(rng, [5] * 9, SHAPES), strict=True
        )
    ]
    # Execute
    result = strategy.aggregate(1, shared, updates)
    expected = sampled_only.aggregate(1, shared, [u for u in updates if u.device_id in sample])
    # Assert: all 9 online devices train; only the 2 sampled move the model
    assert plan.devices == tuple(f"dev-{i}" for i in range(10) if i != 3)
    assert len(sample) == 2
    for name in shared:
        torch.testing.assert_close(result.shared[name], expected.shared[name])
    restored = build_strategy(PFedBreDConfig(train_all_clients=True, beta=2.0), 0.2)
    restored.load_state_dict(strategy.state_dict())
    again = restored.aggregate(1, shared, updates)
    for name in shared:
        torch.testing.assert_close(again.shared[name], expected.shared[name])


def test_pfedme_strategy_refuses_another_config() -> None:
    with pytest.raises(TypeError, match="pfedme needs PFedMeConfig"):
        PFedMeStrategy(PFedBreDConfig(), 1.0)


def test_configs_default_to_the_papers_hyperparameters() -> None:
    cfg = PFedBreDConfig()
    assert (cfg.prior, cfg.meta_step_updates_w, cfg.prox_init) == ("mh", True, None)
    assert (cfg.local_steps, cfg.prox_steps, cfg.lr, cfg.personal_lr) == (20, 5, 0.01, 0.01)
    assert (cfg.lam, cfg.eta, cfg.eta_alpha, cfg.beta) == (15.0, 0.05, 0.01, 1.0)
    assert (cfg.batch_size, cfg.train_all_clients, cfg.finetune_steps) == (20, False, 0)
    assert PFedMeConfig().prior_rule() == "identity"
    with pytest.raises(ValueError, match="lam"):
        PFedBreDConfig(lam=0.0)
