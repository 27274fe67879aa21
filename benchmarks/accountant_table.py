"""The accountant against independent ones: this project's epsilon beside dp-accounting and Opacus.

Each configuration runs its rounds through the coordinator's PrivacyEngine (plan, privatize,
finish: what a run does) and reads the epsilon it reports. The references are computed here,
for the same neighbour relation, from the sensitivity of what is released: dp-accounting's RDP
accountant (its default orders) and PLD accountant (its default discretization), and Opacus's
PRV accountant where it is installed (Poisson sampling only: it has no sampling without
replacement). Writes the table into docs/benchmarks.md.

    python -m benchmarks.accountant_table
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import dp_accounting
import torch
from dp_accounting.pld import pld_privacy_accountant as pld
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from benchmarks.common import write_table_section
from coordinator.stages.privacy import PrivacyEngine
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from device_agent.algorithms.base import LocalResult
from device_agent.privacy import privatize
from protocols.messages import DevicePrivacy
from protocols.privacy import PrivacySettings, Sampling

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- accountant-table -->"
DELTA: Final = 1e-5
Relation = dp_accounting.NeighboringRelation


@dataclass(frozen=True)
class Config:
    """One run's accounting: sampling, noise z, cohort of a population, rounds, adaptive clip."""

    sampling: Sampling
    z: float
    population: int
    cohort: int
    rounds: int
    adaptive: bool = False

    def settings(self) -> PrivacySettings:
        """The run's DP settings (the rest at their defaults: delta 1e-5, sigma_b = m/20)."""
        return PrivacySettings(
            noise_multiplier=self.z, sampling=self.sampling, adaptive_clipping=self.adaptive
        )

    def label(self) -> str:
        """The configuration in words, for the table and test ids."""
        drawn = "Poisson" if self.sampling == "poisson" else "fixed"
        clip = ", adaptive clip" if self.adaptive else ""
        return (
            f"{drawn} {self.cohort} of {self.population}, z={self.z:g}, {self.rounds} rounds{clip}"
        )


CONFIGS: Final = (
    Config("poisson", 1.0, 100, 10, 20),
    Config("poisson", 0.8, 1000, 10, 100),
    Config("poisson", 2.0, 200, 50, 30),
    Config("poisson", 1.0, 100, 20, 30, adaptive=True),
    Config("poisson", 1.5, 500, 50, 10, adaptive=True),
    Config("fixed", 1.0, 6, 6, 4),
    Config("fixed", 1.0, 100, 10, 20),
    Config("fixed", 1.219, 200, 50, 30),
    Config("fixed", 1.0, 100, 20, 30, adaptive=True),
    Config("fixed", 3.0, 50, 50, 20, adaptive=True),
)


def fleet(population: int) -> FleetSnapshot:
    """`population` online devices, dev-0000 onwards."""
    return FleetSnapshot(tuple(DeviceInfo(f"dev-{i:04d}", 10, True) for i in range(population)))


def run_engine(config: Config) -> dict[str, float]:
    """The privacy scalars after `config.rounds` rounds, every cohort device answering."""
    engine = PrivacyEngine(config.settings(), config.cohort / config.population, 1)
    everyone, devices = fleet(config.population), [f"dev-{i:04d}" for i in range(config.cohort)]
    shared = {"w": torch.zeros(3)}
    scalars: dict[str, float] = {}
    for _ in range(config.rounds):
        engine.plan(everyone, devices)
        engine.privatize([ReceivedUpdate(d, 1, 0.0, {"w": torch.ones(3)}) for d in devices], shared)
        bits = [0.5 if config.adaptive else None] * config.cohort
        scalars = engine.finish(bits)
    return scalars


def bit_sent(norm: float, clip: float) -> float:
    """The within-clip value a device sends for an update of L2 norm `norm`, noise aside."""
    result = LocalResult({"w": torch.tensor([norm])}, 10, 0.1, {}, {})
    asked = DevicePrivacy(clip_norm=clip, report_clipped=True)
    _, bit = privatize(result, asked, torch.Generator())
    if bit is None:
        msg = "the device sent no within-clip bit"
        raise RuntimeError(msg)
    return bit


def released_multiplier(config: Config) -> float:
    """The multiplier of what one round releases, in add/remove units (one device: C, |bit|).

    The update sum (noise z_delta C) and, with adaptive clipping, the bit sum (noise sigma_b)
    together: (sum over releases of (sensitivity / noise)^2)^(-1/2). The noise is what the
    engine plans for the devices (device placement: m shares of it).
    """
    settings = config.settings().model_copy(update={"placement": "device"})
    engine = PrivacyEngine(settings, config.cohort / config.population, 1)
    devices = [f"dev-{i:04d}" for i in range(config.cohort)]
    planned = engine.plan(fleet(config.population), devices)
    shares = math.sqrt(config.cohort)  # m shares of std s sum to std s * sqrt(m)
    ratio = (planned.clip_norm / (planned.noise_std * shares)) ** 2
    if config.adaptive:
        sensitivity = max(abs(bit_sent(0.5, 1.0)), abs(bit_sent(2.0, 1.0)))
        ratio += (sensitivity / (planned.indicator_std * shares)) ** 2
    return float(ratio**-0.5)


@dataclass(frozen=True)
class Reference:
    """dp-accounting's two figures and Opacus's PRV (None where one has no such event)."""

    rdp: float
    pld: float | None
    prv: float | None

    def tightest(self) -> float:
        """The smallest reference: all are upper bounds."""
        return min(e for e in (self.rdp, self.pld, self.prv) if e is not None)


def reference(config: Config, *, with_prv: bool = False) -> Reference:
    """Independent epsilons for the relation of `config`'s sampling (Opacus's if asked).

    One device moves the release by one unit of `released_multiplier` under add/remove
    (Poisson), and by up to two under replace-one (fixed size).
    """
    z, q = released_multiplier(config), config.cohort / config.population
    prv: tuple[float, float] | None
    if config.sampling == "poisson":
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        relation, tight, prv = Relation.ADD_OR_REMOVE_ONE, event, (z, q)
    else:  # replace one: the release moves twice as far, so noise z is z/2 sensitivities
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            config.population, config.cohort, dp_accounting.GaussianDpEvent(z / 2)
        )
        # the PLD has no sampling without replacement; a full sample is no sampling, and its
        # REPLACE_ONE Gaussian takes the per-device bound (it doubles the sensitivity itself)
        full = config.cohort == config.population
        relation = Relation.REPLACE_ONE
        tight = dp_accounting.GaussianDpEvent(z) if full else None
        prv = (z / 2, 1.0) if full else None  # everyone: a Gaussian of sensitivity 2
    accountant = rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, config.rounds))
    pld_epsilon = None
    if tight is not None:
        composed = pld.PLDAccountant(relation)
        composed.compose(dp_accounting.SelfComposedDpEvent(tight, config.rounds))
        pld_epsilon = composed.get_epsilon(DELTA)
    prv_epsilon = None if prv is None or not with_prv else opacus_prv(*prv, config.rounds)
    return Reference(accountant.get_epsilon(DELTA), pld_epsilon, prv_epsilon)


def opacus_prv(z: float, rate: float, rounds: int) -> float | None:
    """Opacus's PRV accountant (Gopi et al. 2021) for Poisson rounds, None if not installed."""
    try:
        from opacus.accountants import PRVAccountant  # optional: a benchmark-only comparison
    except ImportError:
        return None
    accountant = PRVAccountant()
    accountant.history = [(z, rate, rounds)]
    return float(accountant.get_epsilon(DELTA))


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _difference(value: float, reference_value: float) -> str:
    """Relative difference to 0.01%, a rounded zero unsigned."""
    return f"{value / reference_value - 1:+.2%}".replace("-0.00%", "+0.00%")


def main() -> None:
    """Account every configuration both ways and write the table."""
    rows = []
    for config in CONFIGS:
        scalars = run_engine(config)
        expected = reference(config, with_prv=True)
        reported = scalars["dp_epsilon"]
        relation = "add/remove" if config.sampling == "poisson" else "replace-one"
        rows.append([
            config.label(), relation, _cell(scalars["dp_epsilon_rdp"]),
            _cell(scalars.get("dp_epsilon_pld")), f"**{reported:.3f}**", _cell(expected.rdp),
            _cell(expected.pld), _cell(expected.prv),
            _difference(scalars["dp_epsilon_rdp"], expected.rdp),
            _difference(reported, expected.tightest()),
        ])  # fmt: skip
        print(rows[-1], flush=True)
    header = ["configuration", "relation", "project RDP", "project PLD", "project reports",
              "dp-accounting RDP", "dp-accounting PLD", "Opacus PRV", "RDP vs RDP",
              "reported vs tightest"]  # fmt: skip
    footer = f"delta {DELTA:g}; `python -m benchmarks.accountant_table`."
    write_table_section(REPO / "docs/benchmarks.md", MARKER, header, rows, footer)


if __name__ == "__main__":
    main()
