"""Epsilon against observers who know the cohorts: closed forms, and a simulated run.

A device of the fleet reads every announcement, so for it sampling amplifies nothing: a device
is exposed in the rounds it took part in, each a Gaussian. k Gaussians of multiplier z have
Renyi DP alpha * k / (2 z^2) and the privacy loss of one Gaussian of multiplier z / sqrt(k).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant as pld
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from typer.testing import CliRunner

from coordinator.cli.app import app
from coordinator.engine.rounds import Coordinator
from coordinator.stages.accountant import (
    PLD_INTERVAL,
    RDP_ORDERS,
    FleetAccountant,
    fleet_epsilons,
    relation,
)
from protocols.privacy import Sampling
from tests.coordinator.test_accountant import gaussian_epsilon

DELTA = 1e-5
SENSITIVITY = {"poisson": 1.0, "fixed": 2.0}  # in clip norms: add/remove C, replace-one 2C


def closed_form_rdp(z: float, rounds: int, sampling: Sampling) -> float:
    """Epsilon of the Renyi DP alpha * k * s^2 / (2 z^2) of k Gaussians of sensitivity s."""
    orders = np.asarray(RDP_ORDERS, dtype=np.float64)
    renyi = orders * rounds * SENSITIVITY[sampling] ** 2 / (2 * z**2)
    return float(rdp.compute_epsilon(RDP_ORDERS, renyi, DELTA)[0])


def one_gaussian_pld(z: float, sampling: Sampling) -> float:
    accountant = pld.PLDAccountant(relation(sampling), value_discretization_interval=PLD_INTERVAL)
    accountant.compose(dp_accounting.GaussianDpEvent(z))
    return float(accountant.get_epsilon(DELTA))


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (1.0, 4), (0.8, 9), (2.5, 30)])
def test_a_device_costs_its_rounds_composed_as_gaussians(
    sampling: Sampling, z: float, rounds: int
) -> None:
    spent = fleet_epsilons({"dev-a": {z: rounds}}, sampling, DELTA)
    assert spent.rdp == pytest.approx(closed_form_rdp(z, rounds, sampling), rel=1e-9)
    assert spent.pld == pytest.approx(one_gaussian_pld(z / math.sqrt(rounds), sampling), rel=1e-3)
    exact = gaussian_epsilon(SENSITIVITY[sampling] * math.sqrt(rounds) / z, DELTA)
    assert spent.pld is not None
    assert exact <= spent.pld <= exact * 1.01  # the PLD's rounding is pessimistic, and small
    assert spent.tighter == spent.pld < spent.rdp


def test_the_run_reports_its_most_exposed_device() -> None:
    """Exposure is the summed 1 / z^2: 2 rounds at z=1 (2) outweigh 5 at z=2 (1.25)."""
    taken = {"few-loud": {1.0: 2}, "many-quiet": {2.0: 5}, "mixed": {1.0: 1, 2.0: 3}}
    each = {d: fleet_epsilons({d: t}, "poisson", DELTA) for d, t in taken.items()}
    run = fleet_epsilons(taken, "poisson", DELTA)
    assert run == each["few-loud"]
    assert all(run.tighter >= e.tighter for e in each.values())
    assert each["mixed"].pld == pytest.approx(  # 1 + 3/4: one Gaussian of z = 1/sqrt(1.75)
        one_gaussian_pld(1 / math.sqrt(1.75), "poisson"), rel=1e-3
    )


def test_the_fleet_accountant_keeps_the_worst_device_as_rounds_come() -> None:
    fleet = FleetAccountant("poisson", DELTA)
    assert fleet.epsilons().tighter == 0.0
    rounds: list[tuple[tuple[str, ...], float]] = [
        (("a", "b"), 2.0),
        ((), 1.0),  # nobody sampled: nobody exposed
        (("b",), 2.0),
        (("c",), 1.0),  # c alone at z=1 (1) passes b's two rounds at z=2 (0.5)
        (("a", "c"), 2.0),
    ]
    taken: dict[str, dict[float, int]] = {}
    for cohort, z in rounds:
        spent = fleet.record(cohort, z)
        for device in cohort:
            taken.setdefault(device, {}).setdefault(z, 0)
            taken[device][z] += 1
        assert spent == fleet_epsilons(taken, "poisson", DELTA)
    assert fleet.taken == {"a": {2.0: 2}, "b": {2.0: 2}, "c": {1.0: 1, 2.0: 1}}
    assert fleet.record(("b",), 0.0).tighter == math.inf  # a round without noise


@pytest.mark.slow
def test_a_simulated_run_reports_the_fleet_figure_beside_the_outside_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each round's announced cohort, read as a device reads it, gives the worst device."""
    announced: dict[int, tuple[str, ...]] = {}
    announce = Coordinator.announce

    def read(self: Coordinator, round_id: int, phase: str, plan: Any, **options: Any) -> None:
        if phase == "train" and plan is not None:
            announced[round_id] = tuple(plan.devices)
        announce(self, round_id, phase, plan, **options)

    monkeypatch.setattr(Coordinator, "announce", read)
    command = "simulate --task digits --devices 10 --rounds 5 --participation 0.3 --dp-noise 1.0"
    result = CliRunner().invoke(app, [*command.split(), "--seed", "3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round_id"] for r in records] == [1, 2, 3, 4, 5]
    taken: dict[str, int] = {}
    for record in records:
        scalars = record["scalars"]
        for device in announced.get(record["round_id"], ()):
            taken[device] = taken.get(device, 0) + 1
        most = max(taken.values(), default=0)
        assert most >= 1
        exact = gaussian_epsilon(math.sqrt(most) / scalars["dp_noise_multiplier"], DELTA)
        assert exact <= scalars["dp_epsilon_vs_fleet"] <= exact * 1.01
        assert scalars["dp_epsilon_vs_fleet"] >= scalars["dp_epsilon"]
    assert max(taken.values()) >= 2  # some device took part more than once
    privacy = json.loads((tmp_path / "summary.json").read_text())["privacy"]
    assert privacy["epsilon_vs_fleet"] == scalars["dp_epsilon_vs_fleet"]
    printed = re.search(r"DP epsilon vs fleet\s+│\s+([0-9.]+) │", result.output)
    assert printed is not None
    assert printed[1] == f"{privacy['epsilon_vs_fleet']:.3f}"
