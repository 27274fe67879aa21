"""Server optimizers: FedAdam against a hand-computed Adam, FedAvg's SGD step, persistence."""

import json
import math

import pytest
import torch

from coordinator.strategies.server_optimizer import (
    AdamState,
    ServerAdam,
    ServerSgd,
    adam_step,
    build_server_optimizer,
)
from protocols.algorithms import FedAltConfig, FedAvgConfig

ROUND_DELTAS = ([0.5, -0.1, 0.0], [0.2, 0.3, -0.4])  # mean shared deltas (local - global)


def _by_hand(u: list[float], lr: float, beta1: float, beta2: float, eps: float) -> list[float]:
    """Two Adam steps on g = -delta, written out per coordinate."""
    m = [0.0] * len(u)
    v = [0.0] * len(u)
    for t, delta in enumerate(ROUND_DELTAS, start=1):
        for i, d in enumerate(delta):
            g = -d
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t)
            v_hat = v[i] / (1 - beta2**t)
            u[i] = u[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
    return u


@pytest.mark.parametrize(("beta1", "beta2", "eps"), [(0.9, 0.999, 1e-8), (0.5, 0.9, 1e-3)])
def test_fedadam_two_rounds_equal_a_hand_computed_adam(
    beta1: float, beta2: float, eps: float
) -> None:
    # Prepare
    start = [1.0, -2.0, 0.25]
    optimizer = ServerAdam(lr=0.1, beta1=beta1, beta2=beta2, eps=eps)
    shared = {"w": torch.tensor(start, dtype=torch.float64)}
    # Execute
    for delta in ROUND_DELTAS:
        shared = optimizer.step(shared, {"w": torch.tensor(delta, dtype=torch.float64)})
    # Assert: by hand, and torch.optim.Adam on the pseudo-gradient as a second oracle
    expected = _by_hand(list(start), 0.1, beta1, beta2, eps)
    torch.testing.assert_close(shared["w"], torch.tensor(expected, dtype=torch.float64))
    parameter = torch.nn.Parameter(torch.tensor(start, dtype=torch.float64))
    reference = torch.optim.Adam([parameter], lr=0.1, betas=(beta1, beta2), eps=eps)
    for delta in ROUND_DELTAS:
        parameter.grad = -torch.tensor(delta, dtype=torch.float64)
        reference.step()
    torch.testing.assert_close(shared["w"], parameter.detach())
    # ... which is not server SGD at the same step size
    assert optimizer.state.step == 2
    sgd = [u + 0.1 * (a + b) for u, a, b in zip(start, *ROUND_DELTAS, strict=True)]
    assert not torch.allclose(shared["w"], torch.tensor(sgd, dtype=torch.float64), atol=1e-3)


def test_adam_step_is_pure_and_keeps_dtypes_and_counters() -> None:
    shared = {"w": torch.ones(2, dtype=torch.float32), "count": torch.tensor(4)}
    gradient = {"w": torch.tensor([0.5, -0.5]), "count": torch.tensor(-2.0)}
    state = AdamState()
    new, new_state = adam_step(shared, gradient, state, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    assert state.step == 0
    assert not state.first_moment
    assert new_state.step == 1
    assert set(new_state.first_moment) == {"w"}
    assert new["w"].dtype == torch.float32
    torch.testing.assert_close(new["w"], torch.tensor([0.9, 1.1]))
    assert new["count"].dtype == torch.int64
    assert int(new["count"]) == 6


def test_fedadam_state_survives_a_json_checkpoint() -> None:
    # Prepare: one round, then checkpoint through JSON text
    shared = {"w": torch.tensor([[1.0, 2.0]]), "b": torch.tensor(0.5)}
    first = {"w": torch.tensor([[0.1, -0.2]]), "b": torch.tensor(0.3)}
    second = {"w": torch.tensor([[-0.4, 0.2]]), "b": torch.tensor(-0.1)}
    original = ServerAdam(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8)
    shared = original.step(shared, first)
    restored = ServerAdam(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    fresh = ServerAdam(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8)
    # Execute
    continued = original.step(shared, second)
    resumed = restored.step(shared, second)
    restarted = fresh.step(shared, second)
    # Assert
    for name in shared:
        torch.testing.assert_close(resumed[name], continued[name])
    assert not torch.allclose(restarted["w"], continued["w"])


def test_malformed_fedadam_state_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        ServerAdam(0.1, 0.9, 0.999, 1e-8).load_state_dict({"step": "x", "first_moment": {}})


def test_server_sgd_is_the_fedavg_step_and_keeps_no_state() -> None:
    optimizer = ServerSgd(lr=0.5)
    new = optimizer.step({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.2, -0.4])})
    torch.testing.assert_close(new["w"], torch.tensor([1.1, 1.8]))
    assert optimizer.state_dict() == {}


def test_the_config_selects_the_server_optimizer() -> None:
    adam = build_server_optimizer(
        FedAltConfig(server_optimizer="fedadam", server_lr=0.01, adam_eps=1e-3)
    )
    assert isinstance(adam, ServerAdam)
    assert (adam.lr, adam.beta1, adam.beta2, adam.eps) == (0.01, 0.9, 0.999, 1e-3)
    assert isinstance(build_server_optimizer(FedAvgConfig(server_lr=0.5)), ServerSgd)
