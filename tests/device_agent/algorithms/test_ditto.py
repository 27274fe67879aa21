from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from device_agent.algorithms.base import LocalContext
from device_agent.algorithms.ditto import DittoUpdate
from device_agent.algorithms.fedavg import FedAvgUpdate
from device_agent.algorithms.theta import THETA
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.split import ParamSplit
from protocols.algorithms import DittoConfig, FedAvgConfig
from tests.device_agent.algorithms.linear_problem import LeastSquares

NAMES = ("output.weight", "output.bias")


def _context(config, *, state=None, shift: float = 0.0) -> LocalContext:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3))
    y = x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(output=nn.Linear(3, 1))).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(shift)
    split = Split(torch.tensor(x), torch.tensor(y))
    return LocalContext(
        model=model,
        task=LeastSquares(),
        data=DeviceData(0, split, split, split),
        split=ParamSplit(shared=NAMES, personal=()),
        config=config,
        global_shared={k: v.detach().clone() for k, v in model.state_dict().items()},
        personal={},
        generator=torch.Generator().manual_seed(0),
        state=dict(state or {}),
    )


def _theta_by_hand(ctx: LocalContext, theta, lam: float, lr: float, steps: int):
    """Full-batch GD on mean squared error + lam/2 ||theta - w_global||^2."""
    x, y = ctx.data.train.inputs.numpy(), ctx.data.train.targets.numpy()
    w = ctx.global_shared["output.weight"].numpy()
    b = ctx.global_shared["output.bias"].numpy()
    tw, tb = theta["output.weight"].numpy().copy(), theta["output.bias"].numpy().copy()
    for _ in range(steps):
        r = x @ tw.T + tb - y
        gw = 2 / len(x) * r.T @ x + lam * (tw - w)
        gb = 2 / len(x) * r.sum(axis=0) + lam * (tb - b)
        tw, tb = tw - lr * gw, tb - lr * gb
    return tw, tb


def test_ditto_personal_steps_match_the_closed_form_and_w_trains_as_fedavg() -> None:
    # Prepare: a stored theta away from w; 3 full-batch passes; a separate personal lr
    stored = {THETA + k: v + 0.7 for k, v in _context(DittoConfig()).global_shared.items()}
    config = DittoConfig(lam=2.0, lr=0.05, personal_lr=0.03, local_epochs=3, batch_size=10)
    ctx = _context(config, state=stored)
    # Execute
    result = DittoUpdate().run(ctx)
    # Assert: theta by hand; the shared delta is FedAvg's exactly
    theta = {n: stored[THETA + n] for n in NAMES}
    tw, tb = _theta_by_hand(ctx, theta, lam=2.0, lr=0.03, steps=3)
    np.testing.assert_allclose(result.state[THETA + "output.weight"].numpy(), tw, rtol=1e-9)
    np.testing.assert_allclose(result.state[THETA + "output.bias"].numpy(), tb, rtol=1e-9)
    fedavg = FedAvgUpdate().run(_context(FedAvgConfig(lr=0.05, local_epochs=3, batch_size=10)))
    for name in NAMES:
        assert torch.allclose(result.shared_delta[name], fedavg.shared_delta[name], rtol=1e-12)
    assert set(result.state) == {THETA + n for n in NAMES}


@pytest.mark.parametrize("shift", [0.0, 2.0])
def test_zero_lambda_ignores_the_global_model(shift: float) -> None:
    # Prepare: the same stored theta, two different global models
    stored = {THETA + k: v + 0.7 for k, v in _context(DittoConfig()).global_shared.items()}
    config = DittoConfig(lam=0.0, lr=0.05, local_epochs=3, batch_size=10)
    baseline = DittoUpdate().run(_context(config, state=stored))
    # Execute
    result = DittoUpdate().run(_context(config, state=stored, shift=shift))
    # Assert
    for name in NAMES:
        assert torch.allclose(result.state[THETA + name], baseline.state[THETA + name])


def test_large_lambda_tracks_the_global_model() -> None:
    # Prepare: theta starts far (+3) from the global model
    stored = {THETA + k: v + 3.0 for k, v in _context(DittoConfig()).global_shared.items()}

    def gap(lam: float) -> float:
        ctx = _context(DittoConfig(lam=lam, lr=0.01, local_epochs=40, batch_size=10), state=stored)
        result = DittoUpdate().run(ctx)
        return sum(
            float(((result.state[THETA + n] - ctx.global_shared[n]) ** 2).sum()) for n in NAMES
        )

    # Execute / Assert
    assert gap(50.0) < 1e-3 * gap(0.0)


def test_first_round_starts_theta_at_w_and_personalize_deploys_theta() -> None:
    config = DittoConfig(lam=1.0, lr=0.05, local_epochs=2, batch_size=10)
    first = _context(config)
    result = DittoUpdate().run(first)
    tw, tb = _theta_by_hand(first, first.global_shared, lam=1.0, lr=0.05, steps=2)
    np.testing.assert_allclose(result.state[THETA + "output.weight"].numpy(), tw, rtol=1e-9)
    np.testing.assert_allclose(result.state[THETA + "output.bias"].numpy(), tb, rtol=1e-9)
    ctx = _context(config, state=result.state)
    DittoUpdate().personalize(ctx)
    for name, value in ctx.model.state_dict().items():
        assert torch.equal(value, result.state[THETA + name])
