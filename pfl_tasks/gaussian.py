"""The Gaussian task: Self-FL's scalar two-level Gaussian model, with a known Bayes answer."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from pfl_tasks.base import DeviceData, Split
from pfl_tasks.models import check_int, check_real
from pfl_tasks.per_device import PerDeviceRegression


class ScalarMeanModel(nn.Module):
    """A model that is one scalar `theta`: its prediction for every input.

    The input only carries the batch size, so the task fits the same training, export and
    messaging paths as any other model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Theta repeated for each row of `x`, shape (batch, 1)."""
        return self.theta.expand(x.shape[0], 1)


class GaussianTask(PerDeviceRegression):
    """Self-FL's synthetic scalar data (selffl.md 5.1): the closed-form posterior is the oracle.

    theta_m ~ N(theta_0, sigma0_sq); device m observes N_m ~ Uniform{n_min..n_max} (inclusive)
    draws from N(theta_m, obs_var). The train split holds those N_m observations; validation and
    test hold fresh draws from the same N(theta_m, obs_var). Case 1 of the paper is
    sigma0_sq=0.001, n_min=10, n_max=20; case 2 (the defaults) is sigma0_sq=1, n 10..200.

    With loss 0.5 * mean((theta - y)^2), one gradient step of size eta moves theta by
    eta * (mean(y) - theta), toward the sample mean z_m, which is the spec's local update.

    personal_patterns is empty: Self-FL personalizes the whole model (here the single scalar),
    so nothing is held back from the shared update by name. Data are generated per device, so
    the partition spec is ignored entirely (split sizes are the n_* options), and device m's data
    depend only on (seed, m).

    Args:
        sigma0_sq: Inter-device variance of theta_m around theta_0.
        obs_var: Variance of one observation around theta_m.
        n_min: Fewest train observations a device gets.
        n_max: Most train observations a device gets.
        theta_0: The parent parameter.
        n_test: Test observations per device.
        n_val: Validation observations per device (0 allowed).
    """

    name: ClassVar[str] = "gaussian"
    output_names: tuple[str, ...] = ("theta",)

    def __init__(
        self,
        sigma0_sq: float = 1.0,
        obs_var: float = 0.1,
        n_min: int = 10,
        n_max: int = 200,
        theta_0: float = 1.6,
        n_test: int = 100,
        n_val: int = 10,
    ) -> None:
        self.sigma0_sq = check_real("sigma0_sq", sigma0_sq)
        self.obs_var = check_real("obs_var", obs_var, bound="positive")
        self.n_min = check_int("n_min", n_min)
        self.n_max = check_int("n_max", n_max)
        if self.n_max < self.n_min:
            msg = f"n_max must be at least n_min, got n_min={n_min}, n_max={n_max}"
            raise ValueError(msg)
        self.theta_0 = check_real("theta_0", theta_0, bound="any")
        self.n_test = check_int("n_test", n_test)
        self.n_val = check_int("n_val", n_val, minimum=0)

    def build_model(self, seed: int) -> nn.Module:
        """Theta starts at 0.0 whatever the seed, as in the spec's experiments (theta^0 = 0)."""
        return ScalarMeanModel()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Half the mean squared error, so the gradient is (theta - sample mean)."""
        return 0.5 * torch.mean((outputs - targets) ** 2)

    def _make_device(self, device_index: int, rng: np.random.Generator) -> DeviceData:
        theta_m = float(rng.normal(self.theta_0, math.sqrt(self.sigma0_sq)))
        num_observations = int(rng.integers(self.n_min, self.n_max, endpoint=True))
        obs_std = math.sqrt(self.obs_var)

        def draw(count: int) -> Split:
            values = rng.normal(theta_m, obs_std, size=(count, 1)).astype(np.float32)
            return Split(torch.zeros((count, 1)), torch.from_numpy(values))

        truth = {
            "theta": theta_m,
            "theta_0": self.theta_0,
            "sigma0_sq": self.sigma0_sq,
            "obs_var": self.obs_var,
            "num_observations": num_observations,
        }
        return self._drawn(device_index, draw, num_observations, truth)
