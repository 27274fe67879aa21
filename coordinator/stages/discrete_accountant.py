"""Renyi DP of one round of the distributed discrete Gaussian (`protocols.discrete_gaussian`).

The sum of k devices' N_Z(0, s^2) shares is not itself a discrete Gaussian. Kairouz, Liu and
Steinke 2021, Theorem 1: for a shift of L2 norm at most D it is rho-zCDP, i.e. its Renyi
divergence at every order a is at most a eps^2 / 2, with

    eps = D / (sqrt(k) s) + tau sqrt(d),   tau = 10 sum_{j=1}^{k-1} exp(-2 pi^2 s^2 j / (j + 1)),

everything in the ring's units: D the rounding's norm bound (`rounding_bound`: conditional
rounding, not the clip norm, is the sensitivity), s a device's share, d the coordinates. The
paper's other form, sqrt(D^2 / (k s^2) + tau d / 2), is not used (the minimum of the two would
only tighten it; at the ring's scales tau underflows to 0 and both are D / (sqrt(k) s)).

Dropouts are counted: k is the number of devices whose noise is in the sum, not the cohort.
Replace-one neighbours (`--dp-sampling fixed`) move the sum by up to 2D; sampling without
replacement is not amplified here (a valid, looser bound: a subsampled mechanism's Renyi
divergence is at most its base mechanism's). Poisson sampling at rate q is amplified by Zhu and
Wang 2019's general bound for any mechanism's RDP (Theorem 5 of "Poisson Subsampled Renyi
Differential Privacy"), at integer orders; it is not the Gaussian-specific bound, which assumes
the continuous Gaussian's privacy loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocols.discrete_gaussian import rounding_bound


@dataclass(frozen=True)
class RingRound:
    """One released sum of discrete Gaussian shares, in the ring's units."""

    sensitivity: float
    """The rounded vector's L2 bound D (add/remove one device)."""
    device_std: float
    """One device's noise share s."""
    devices: int
    """Devices whose shares are in the sum (the survivors)."""
    dimension: int

    @classmethod
    def of(
        cls, clip_norm: float, scale: float, device_std: float, devices: int, dimension: int
    ) -> RingRound:
        """The round of `devices` shares of `device_std` (delta units) on a grid of `scale`."""
        bound = rounding_bound(clip_norm * scale, dimension)
        return cls(bound, device_std * scale, devices, dimension)

    @property
    def tau(self) -> float:
        """The paper's tau: how far the sum of k discrete Gaussians is from one."""
        s2 = self.device_std**2
        return 10 * sum(
            math.exp(-2 * math.pi**2 * s2 * j / (j + 1)) for j in range(1, self.devices)
        )

    def epsilon(self, shift: float = 1.0) -> float:
        """Theorem 1's eps for shifts of up to `shift` D (2 under replace-one): rho = eps^2/2."""
        if self.devices < 1 or self.device_std <= 0:
            return math.inf
        spread = math.sqrt(self.devices) * self.device_std
        return shift * self.sensitivity / spread + self.tau * math.sqrt(self.dimension)


def ring_rdp(spent: RingRound, rate: float, shift: float, orders: Sequence[float]) -> np.ndarray:
    """The round's Renyi DP at each order, Poisson-sampled at `rate` (1: not sampled)."""
    rho = spent.epsilon(shift) ** 2 / 2
    base = np.asarray([rho * a for a in orders], dtype=np.float64)
    if rate >= 1 or not math.isfinite(rho):
        return base
    sampled = [
        min(rho * a, poisson_subsampled(int(a), rate, rho)) if float(a).is_integer() else rho * a
        for a in orders
    ]
    return np.asarray(sampled, dtype=np.float64)


def poisson_subsampled(order: int, rate: float, rho: float) -> float:
    """Zhu and Wang 2019, Theorem 5, for a base mechanism of RDP eps(a) = rho a, at an integer a.

    log((1-q)^(a-1) (a q - q + 1) + C(a,2) q^2 (1-q)^(a-2) e^eps(2)
        + 3 sum_{l=3}^{a} C(a,l) q^l (1-q)^(a-l) e^((l-1) eps(l))) / (a - 1)
    """
    if order < 2:
        return math.inf
    log_q, log_p = math.log(rate), math.log1p(-rate)
    from scipy import special  # imported here: a run without DP never loads scipy

    levels = np.arange(3, order + 1, dtype=np.float64)
    log_binomial = (
        special.gammaln(order + 1)
        - special.gammaln(levels + 1)
        - special.gammaln(order - levels + 1)
    )
    exponents = np.concatenate(
        [
            [0.0, 2 * rho],
            (levels - 1) * rho * levels + log_binomial + (order - levels) * log_p + levels * log_q,
        ]
    )
    weights = np.concatenate(
        [
            [
                (1 - rate) ** (order - 1) * (order * rate - rate + 1),
                special.comb(order, 2) * rate**2 * (1 - rate) ** (order - 2),
            ],
            np.full(levels.size, 3.0),
        ]
    )
    return float(special.logsumexp(exponents, b=weights)) / (order - 1)


def ring_noise_for_epsilon(
    target_epsilon: float, delta: float, rate: float, rounds: int, orders: Sequence[float]
) -> float:
    """The noise multiplier z whose `rounds` Poisson rounds at `rate` spend `target_epsilon`.

    For planning: every device answers and the grid is fine enough that the rounding and tau
    vanish (eps = 1/z; on a 32-bit ring they add under 0.1%), so a run spends about this.
    """
    from dp_accounting.rdp import rdp_privacy_accountant as rdp
    from scipy import optimize

    def excess(z: float) -> float:
        curve = rounds * ring_rdp(RingRound(1.0, z, 1, 0), rate, 1, orders)
        return float(rdp.compute_epsilon(orders, curve, delta)[0]) - target_epsilon

    high = 1.0
    while excess(high) > 0:
        high *= 2
    return float(optimize.brentq(excess, high / 1024, high, xtol=1e-4))
