from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from device_agent.algorithms.base import LocalContext
from device_agent.algorithms.fedprox import FedProxUpdate
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.split import ParamSplit
from protocols.algorithms import FedProxConfig
from tests.squared_loss import SquaredLoss


def _closed_form(x, y, w0, b0, lr, mu, steps) -> tuple[np.ndarray, np.ndarray]:
    """Full-batch gradient descent on mean squared error + mu/2 ||theta - theta0||^2."""
    w, b = w0.copy(), b0.copy()
    n = len(x)
    for _ in range(steps):
        residual = x @ w + b - y
        grad_w = 2 / n * x.T @ residual + mu * (w - w0)
        grad_b = 2 / n * residual.sum(axis=0) + mu * (b - b0)
        w, b = w - lr * grad_w, b - lr * grad_b
    return w, b


def test_fedprox_local_steps_match_the_closed_form_gradient_descent() -> None:
    # Prepare: full batch, several epochs, a strong proximal term that separates it from FedAvg
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3))
    y = x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3
    model = nn.Sequential(OrderedDict(output=nn.Linear(3, 1))).double()
    global_shared = {k: v.detach().clone() for k, v in model.state_dict().items()}
    split = Split(torch.tensor(x), torch.tensor(y))
    config = FedProxConfig(lr=0.05, mu=2.0, local_epochs=4, batch_size=12)
    ctx = LocalContext(
        model=model,
        task=SquaredLoss(),
        data=DeviceData(0, split, split, split),
        split=ParamSplit(shared=("output.weight", "output.bias"), personal=()),
        config=config,
        global_shared=global_shared,
        personal={},
        generator=torch.Generator().manual_seed(0),
    )
    w0 = global_shared["output.weight"].numpy().T
    b0 = global_shared["output.bias"].numpy()
    # Execute
    result = FedProxUpdate().run(ctx)
    # Assert
    w, b = _closed_form(x, y, w0, b0, lr=0.05, mu=2.0, steps=4)
    np.testing.assert_allclose(result.shared_delta["output.weight"].numpy().T, w - w0, rtol=1e-9)
    np.testing.assert_allclose(result.shared_delta["output.bias"].numpy(), b - b0, rtol=1e-9)
    w_avg, _ = _closed_form(x, y, w0, b0, lr=0.05, mu=0.0, steps=4)
    assert not np.allclose(w, w_avg, rtol=1e-3)
    assert result.num_samples == 12
