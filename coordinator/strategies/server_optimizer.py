"""Server optimizers: how a round's mean shared delta moves the shared model (spec §1.5).

Both take the mean delta (local - global); the pseudo-gradient of Reddi et al. (2021) is its
negative. State persists across rounds and round-trips through plain JSON values, so a
checkpoint can hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

import torch

from coordinator.strategies.aggregate import apply_delta
from protocols.algorithms import FedAvgConfig, ServerOptimizerName
from protocols.codec import Tensors


@dataclass(frozen=True)
class AdamState:
    """Adam's step count and float64 moment estimates, per shared tensor name."""

    step: int = 0
    first_moment: Tensors = field(default_factory=dict)
    second_moment: Tensors = field(default_factory=dict)


def adam_step(
    shared: Mapping[str, torch.Tensor],
    pseudo_gradient: Mapping[str, torch.Tensor],
    state: AdamState,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> tuple[Tensors, AdamState]:
    """One FedAdam server step with bias correction (spec §1.5, defaults §7.3).

    With g the pseudo-gradient and t = state.step + 1:
    m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2,
    u = u - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps), as torch.optim.Adam.
    Integer tensors (counters) carry no moments: they take u - g, rounded.

    Returns:
        The new shared tensors (in their own dtypes) and the new state.
    """
    t = state.step + 1
    first, second = dict(state.first_moment), dict(state.second_moment)
    result: Tensors = {}
    for name, value in shared.items():
        gradient = pseudo_gradient[name].to(torch.float64)
        if not value.is_floating_point():
            result[name] = (value.to(torch.float64) - gradient).round().to(value.dtype)
            continue
        m = beta1 * first.get(name, torch.zeros_like(gradient)) + (1 - beta1) * gradient
        v = beta2 * second.get(name, torch.zeros_like(gradient)) + (1 - beta2) * gradient**2
        first[name], second[name] = m, v
        step = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        result[name] = (value.to(torch.float64) - lr * step).to(value.dtype)
    return result, AdamState(t, first, second)


class ServerOptimizer(Protocol):
    """Applies a round's mean shared delta to the shared model."""

    def step(self, shared: Mapping[str, torch.Tensor], mean_delta: Tensors) -> Tensors:
        """The next shared model."""
        ...

    def state_dict(self) -> dict[str, object]:
        """State to checkpoint, as plain JSON values."""
        ...

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from `state_dict()`'s output."""
        ...


class ServerSgd:
    """FedAvg's server step: u + lr * mean delta (lr 1 gives exactly the weighted mean)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def step(self, shared: Mapping[str, torch.Tensor], mean_delta: Tensors) -> Tensors:
        """SGD on the pseudo-gradient -mean_delta."""
        return apply_delta(shared, mean_delta, self.lr)

    def state_dict(self) -> dict[str, object]:
        """Plain SGD keeps no state."""
        return {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Nothing to restore."""
        del state


class ServerAdam:
    """FedAdam: `adam_step` on the pseudo-gradient, state kept across rounds."""

    def __init__(self, lr: float, beta1: float, beta2: float, eps: float) -> None:
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.state = AdamState()

    def step(self, shared: Mapping[str, torch.Tensor], mean_delta: Tensors) -> Tensors:
        """Adam on -mean_delta."""
        pseudo_gradient = {name: -delta for name, delta in mean_delta.items()}
        result, self.state = adam_step(
            shared,
            pseudo_gradient,
            self.state,
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
        )
        return result

    def state_dict(self) -> dict[str, object]:
        """Step count and moments as nested lists of floats."""
        return {
            "step": self.state.step,
            "first_moment": {k: v.tolist() for k, v in self.state.first_moment.items()},
            "second_moment": {k: v.tolist() for k, v in self.state.second_moment.items()},
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore; an empty mapping (a checkpoint from before any step) resets.

        Raises:
            ValueError: the mapping is not what `state_dict()` produces.
        """
        if not state:
            self.state = AdamState()
            return
        step = state.get("step")
        first, second = state.get("first_moment"), state.get("second_moment")
        if not isinstance(step, int) or not isinstance(first, dict) or not isinstance(second, dict):
            msg = "FedAdam state needs an int 'step' and dicts 'first_moment', 'second_moment'"
            raise ValueError(msg)
        self.state = AdamState(
            step,
            {k: torch.tensor(v, dtype=torch.float64) for k, v in first.items()},
            {k: torch.tensor(v, dtype=torch.float64) for k, v in second.items()},
        )


def _sgd(config: FedAvgConfig) -> ServerOptimizer:
    return ServerSgd(config.server_lr)


def _adam(config: FedAvgConfig) -> ServerOptimizer:
    return ServerAdam(config.server_lr, config.adam_beta1, config.adam_beta2, config.adam_eps)


SERVER_OPTIMIZERS: Final[dict[ServerOptimizerName, Callable[[FedAvgConfig], ServerOptimizer]]] = {
    "fedavg": _sgd,
    "fedadam": _adam,
}


def build_server_optimizer(config: FedAvgConfig) -> ServerOptimizer:
    """The server optimizer `config.server_optimizer` names (validated by the config model)."""
    return SERVER_OPTIMIZERS[config.server_optimizer](config)
