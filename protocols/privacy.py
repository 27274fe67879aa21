"""Client-level differential privacy: the run's settings and the math both sides share.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"):
each selected device's shared delta is clipped to an L2 norm C, Gaussian noise of standard
deviation z*C is added to the sum of the clipped deltas, and the sum is divided by the expected
cohort. The noise is added by the coordinator (it sees clipped updates, and is trusted) or split
over the devices, each adding N(0, (z*C)^2 / m) so that the m shares sum to the target
(distributed DP, meant to run under secure aggregation). Adaptive clipping follows Andrew et al.
2021, "Differentially Private Learning with Adaptive Clipping": devices report whether their
update was within C as a centred bit (+-1/2), the noised fraction moves C geometrically towards
a target quantile, and the update noise is raised so that both releases together cost what z
alone would.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocols.codec import Tensors

Placement = Literal["coordinator", "device"]
Distribution = Literal["gaussian", "discrete-gaussian"]
Sampling = Literal["poisson", "fixed"]
Mechanism = Literal["dp-fedavg", "ftrl-tree"]


class PrivacySettings(BaseModel):
    """A run's DP, from its `--dp-*` flags (and `[dp_options]` in its TOML); see RunSettings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    noise_multiplier: Annotated[float, Field(ge=0, le=1e6)] = 1.0
    """z: the noise's standard deviation on the sum, in units of the clip norm."""
    clip_norm: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    """C: every shared delta is scaled down to at most this L2 norm (the initial C if adaptive)."""
    placement: Placement = "coordinator"
    sampling: Sampling = "poisson"
    """poisson: each device joins a round independently with probability `participation`
    (add/remove-one-device privacy); fixed: a uniform sample of that many (replace-one)."""
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    target_epsilon: Annotated[float, Field(gt=0)] | None = None
    """The budget: once a round would pass it, the run stops (or warns, see `on_budget`)."""
    on_budget: Literal["stop", "warn"] = "stop"
    adaptive_clipping: bool = False
    target_quantile: Annotated[float, Field(gt=0, lt=1)] = 0.5
    clip_learning_rate: Annotated[float, Field(gt=0, le=10)] = 0.2
    quantile_noise: Annotated[float, Field(gt=0, le=10)] = 0.05
    """sigma_b as a fraction of the expected cohort (Andrew et al. use m/20)."""
    distribution: Distribution = "gaussian"
    """gaussian: real-valued noise; discrete-gaussian: devices add integer noise inside secure
    aggregation's ring (`protocols.discrete_gaussian`; device placement only)."""
    mechanism: Mechanism = "dp-fedavg"
    """dp-fedavg: fresh noise on each round's sum; ftrl-tree: DP-FTRL's tree aggregation
    (coordinator/stages/ftrl.py), the cohort taken as selected and accounted with no
    amplification."""
    tree_restart: Annotated[int, Field(ge=1)] | None = None
    """ftrl-tree: rounds per tree (None: one tree for the whole run)."""
    tree_participations: Annotated[int, Field(ge=1)] | None = None
    """ftrl-tree: the most rounds of one tree a device joins (None: every round)."""

    @model_validator(mode="after")
    def _adaptive_needs_noise(self) -> PrivacySettings:
        if self.adaptive_clipping and self.noise_multiplier == 0:
            msg = "adaptive clipping spends part of the noise: it needs a noise_multiplier above 0"
            raise ValueError(msg)
        problem = tree_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _discrete_on_devices(self) -> PrivacySettings:
        if self.distribution == "discrete-gaussian" and self.placement != "device":
            msg = (
                "distribution discrete-gaussian (--dp-distribution) is added by the devices in "
                "secure aggregation's ring: it needs placement device (--dp-placement device)"
            )
            raise ValueError(msg)
        if self.distribution == "discrete-gaussian" and self.adaptive_clipping:
            msg = (
                "adaptive clipping's within-clip bit has no discrete-Gaussian form yet: "
                "use a fixed clip with the discrete Gaussian"
            )
            raise ValueError(msg)
        return self


FTRL_REFUSES: dict[str, str] = {
    "sampling": "ftrl-tree draws no secret sample (its guarantee does not rest on one): "
    "the cohort is taken as the strategy selects it; leave --dp-sampling unset",
    "placement": "ftrl-tree's tree noise is added by the coordinator: --dp-placement device "
    "would need every device to hold the tree",
    "adaptive_clipping": "ftrl-tree keeps one clip norm (every tree node carries the same "
    "noise): --dp-adaptive-clip is not supported with it",
}


def tree_problem(settings: PrivacySettings) -> str:
    """Why these settings cannot run DP-FTRL's tree aggregation ("" when they can, or dp-fedavg).

    Tree-only options without the tree are refused too: they would be ignored.
    """
    if settings.mechanism != "ftrl-tree":
        if settings.tree_restart is not None or settings.tree_participations is not None:
            return "tree_restart and tree_participations need --dp-mechanism ftrl-tree"
        return ""
    offending = {
        "sampling": settings.sampling != "fixed",
        "placement": settings.placement != "coordinator",
        "adaptive_clipping": settings.adaptive_clipping,
    }
    return "; ".join(FTRL_REFUSES[name] for name, bad in offending.items() if bad)


def update_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over every floating tensor together (integer tensors are counters).

    Accumulated in float64 by numpy's pairwise summation over all the tensors at once: a few
    calls per update however many tensors it has (the aggregate guard takes one per device),
    and the same bits whatever the number of threads.
    """
    floating = [_flat_array(t) for t in delta.values() if t.is_floating_point()]
    if not floating:
        return 0.0
    values = np.concatenate(floating, dtype=np.float64)
    return math.sqrt(float(np.add.reduce(values * values)))


def _flat_array(tensor: torch.Tensor) -> np.ndarray:
    if tensor.requires_grad or not tensor.is_cpu:  # only when needed: the calls cost more
        tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        tensor = tensor.float()
    return tensor.numpy().reshape(-1)


def clip_to_norm(delta: Mapping[str, torch.Tensor], max_norm: float) -> Tensors:
    """Scale one update so its L2 norm over all floating tensors is at most `max_norm`.

    delta * min(1, max_norm / ||delta||_2), the norm taken over every floating tensor together
    (DP-FedAvg's clipping; also norm-bounded aggregation, Sun et al. 2019). Integer tensors
    are returned unchanged.

    Raises:
        ValueError: `max_norm` is not positive.
    """
    if not max_norm > 0:
        msg = f"max_norm must be positive, got {max_norm}"
        raise ValueError(msg)
    norm = update_norm(delta)
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {
        name: (t.to(torch.float64) * scale).to(t.dtype) if t.is_floating_point() else t.clone()
        for name, t in delta.items()
    }


def add_gaussian_noise(
    tensors: Mapping[str, torch.Tensor], std: float, generator: torch.Generator
) -> Tensors:
    """Each floating tensor plus i.i.d. N(0, std^2) noise, drawn in float64 in name order."""
    noised: Tensors = {}
    for name in sorted(tensors):
        value = tensors[name]
        if not value.is_floating_point() or std == 0:
            noised[name] = value.clone()
            continue
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * std
        noised[name] = (value.to(torch.float64) + noise).to(value.dtype)
    return noised


def noise_generator(reproducible_seed: int | None) -> torch.Generator:
    """A generator for DP noise, seeded from the OS's entropy unless a seed is given.

    On a real device or coordinator nobody may predict, and so subtract, the noise; a
    simulation passes a seed derived from the run so that its results do not depend on the
    number of workers.
    """
    return torch.Generator().manual_seed(secrets_seed(reproducible_seed))


def secrets_seed(reproducible_seed: int | None) -> int:
    """A seed for DP noise: from the OS's entropy unless a simulation gives its own."""
    return secrets.randbits(63) if reproducible_seed is None else reproducible_seed


def within_clip_bit(norm: float, clip_norm: float) -> float:
    """+1/2 if an update of L2 norm `norm` is within the clip, else -1/2 (before its noise).

    Centred, so that adding or removing one device moves the count by at most 1/2: Andrew et
    al. 2021's (2 sigma_b) term in `update_noise_multiplier` rests on it (a {0, 1} bit moves it
    by 1, and the pair would cost (z_delta^-2 + sigma_b^-2)^(-1/2), not z).
    """
    return 0.5 if norm <= clip_norm else -0.5


def within_fraction(centred_count: float, cohort: float) -> float:
    """The fraction of the cohort within the clip, from the sum of their centred bits.

    sum(b_i - 1/2) / m + 1/2 (Andrew et al. 2021, Algorithm 1): unbiased when the expected
    cohort m answered on average, as Poisson sampling's does.
    """
    return centred_count / cohort + 0.5


def update_noise_multiplier(noise_multiplier: float, indicator_std: float) -> float:
    """z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), the update's share of the noise.

    Adaptive clipping also releases the noised sum of the centred within-clip bits
    (`within_clip_bit`, sensitivity 1/2 under add/remove); together the two cost what one
    Gaussian release with z does (Andrew et al. 2021, Theorem 1). Under replace-one both
    sensitivities double (2C and 1), and so the pair still costs what z does there.

    Raises:
        ValueError: sigma_b too small to leave the update any budget (2 sigma_b <= z).
    """
    if 2 * indicator_std <= noise_multiplier:
        msg = (
            f"adaptive clipping's count noise {indicator_std:.3g} leaves no budget for the "
            f"update at noise multiplier {noise_multiplier:g} (it needs more than z/2 = "
            f"{noise_multiplier / 2:.3g}): raise quantile_noise or the cohort, or fix the clip"
        )
        raise ValueError(msg)
    return float((noise_multiplier**-2 - (2 * indicator_std) ** -2) ** -0.5)


def next_clip_norm(
    clip_norm: float, unclipped_fraction: float, target_quantile: float, learning_rate: float
) -> float:
    """C * exp(-eta (b - gamma)): the geometric step towards the target quantile.

    b is the noised fraction of updates that were within C (Andrew et al. 2021, eq. 2).
    """
    return clip_norm * math.exp(-learning_rate * (unclipped_fraction - target_quantile))
