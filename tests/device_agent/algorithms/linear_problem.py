"""A two-layer linear least-squares problem whose gradients have a closed form in numpy.

Shared u = `hidden` (A, a), personal v = `output` (B, b): yhat = (x A^T + a) B^T + b.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from device_agent.algorithms.base import LocalContext, LocalResult
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.split import ParamSplit
from protocols.algorithms import AlgorithmConfig
from tests.squared_loss import SquaredLoss

SHARED = ("hidden.weight", "hidden.bias")
PERSONAL = ("output.weight", "output.bias")
Recorded = dict[str, tuple[torch.Tensor, bool, bool]]  # name -> (value, requires_grad, has .grad)


@dataclass
class LeastSquares(SquaredLoss):
    """Mean squared error; records the model's state at every loss call when `model` is set."""

    model: nn.Module | None = None
    calls: list[Recorded] = field(default_factory=list)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.model is not None:  # (value, requires_grad, has .grad) before this step's update
            self.calls.append(
                {
                    n: (p.detach().clone(), p.requires_grad, p.grad is not None)
                    for n, p in self.model.named_parameters()
                }
            )
        return super().loss(outputs, targets)


@dataclass
class Problem:
    x: np.ndarray
    y: np.ndarray
    ctx: LocalContext
    task: LeastSquares

    def params(self) -> dict[str, np.ndarray]:
        """The model's current parameters as numpy arrays."""
        return {k: v.detach().numpy().copy() for k, v in self.ctx.model.state_dict().items()}


def gradients(x: np.ndarray, y: np.ndarray, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Full-batch gradients of mean((yhat - y)^2) w.r.t. every parameter, by hand."""
    n = len(x)
    h = x @ p["hidden.weight"].T + p["hidden.bias"]
    r = h @ p["output.weight"].T + p["output.bias"] - y
    d_out = 2.0 / n * r
    d_h = d_out @ p["output.weight"]
    return {
        "output.weight": d_out.T @ h,
        "output.bias": d_out.sum(axis=0),
        "hidden.weight": d_h.T @ x,
        "hidden.bias": d_h.sum(axis=0),
    }


def descend(
    x: np.ndarray, y: np.ndarray, p: dict[str, np.ndarray], names: tuple[str, ...], lr: float
) -> dict[str, np.ndarray]:
    """One full-batch gradient step on `names` only, all gradients at the same point."""
    g = gradients(x, y, p)
    return {k: v - lr * g[k] if k in names else v for k, v in p.items()}


def assert_round_result(
    result: LocalResult, start: dict[str, np.ndarray], expected: dict[str, np.ndarray]
) -> None:
    """The reported shared delta is expected - start; the kept personal state is expected."""
    assert tuple(result.shared_delta) == SHARED
    assert tuple(result.personal) == PERSONAL
    for name in SHARED:
        np.testing.assert_allclose(
            result.shared_delta[name].numpy(), expected[name] - start[name], rtol=1e-10
        )
    for name in PERSONAL:
        np.testing.assert_allclose(result.personal[name].numpy(), expected[name], rtol=1e-10)


def make_problem(config: AlgorithmConfig, n: int = 12, record: bool = False) -> Problem:
    """A fresh problem (same data and initial model every call) under `config`."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3))
    y = x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + 0.1 * rng.normal(size=(n, 1))
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(hidden=nn.Linear(3, 2), output=nn.Linear(2, 1))).double()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = Split(torch.tensor(x), torch.tensor(y))
    task = LeastSquares(model if record else None)
    ctx = LocalContext(
        model=model,
        task=task,
        data=DeviceData(0, data, data, data),
        split=ParamSplit(shared=SHARED, personal=PERSONAL),
        config=config,
        global_shared={k: state[k] for k in SHARED},
        personal={k: state[k] for k in PERSONAL},
        generator=torch.Generator().manual_seed(0),
    )
    return Problem(x, y, ctx, task)
