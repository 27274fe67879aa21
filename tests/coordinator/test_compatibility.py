"""Every cell of docs/compatibility.md, from the same declarations: "works" runs, "no" refuses.

A "works" cell runs two rounds (three with pretraining) of a tiny simulation and must finish
with finite metrics; a "no" cell must be refused with exactly the declared reason, before any
round.
"""

from __future__ import annotations

import math
import re

import pytest

from coordinator.run.pipeline import plan_stages
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.stages.compatibility import (
    Cell,
    algorithm_cells,
    check,
    feature_cells,
    resolutions,
    stage_configs,
)
from coordinator.stages.features import FEATURES
from pfl_tasks.registry import load_task
from protocols.algorithms import parse_algorithm_config

TINY = {"task": "sine", "devices": 4, "rounds": 2, "seed": 0, "workers": 1}
FEWER_STEPS = {"local_steps": 2}
"""pFedMe's and pFedBreD's 20 prox iterations a round are most of the time: two suffice here."""
CELLS = algorithm_cells() + feature_cells()
FEATURE = {feature.key: feature for feature in FEATURES}


def _settings(cell: Cell) -> SimulationSettings:
    values = {**TINY, **cell.values}
    if values["algorithm"] in ("pfedme", "pfedbred"):
        values["algorithm_options"] = {**FEWER_STEPS, **values.get("algorithm_options", {})}
    return SimulationSettings.load(None, **values)


@pytest.mark.parametrize("cell", CELLS, ids=[f"{c.row} x {c.column}" for c in CELLS])
def test_every_cell_runs_or_is_refused_with_its_declared_reason(cell: Cell) -> None:
    settings = _settings(cell)
    rounds: list[int] = []
    if cell.problem is not None:
        with pytest.raises(ValueError, match=f"^{re.escape(cell.problem)}$"):
            run_simulation(settings, on_round=lambda record: rounds.append(record.round_id))
        assert rounds == []
        return
    result = run_simulation(settings, on_round=lambda record: rounds.append(record.round_id))
    assert rounds == list(range(1, settings.rounds + settings.pretrain_rounds + 1))
    metrics = result.summary.metrics
    assert metrics is not None
    personalized = metrics["personalized_mean"]
    assert personalized is not None
    assert math.isfinite(personalized)
    assert all(math.isfinite(value) for value in metrics.values() if value is not None)


def test_the_tables_hold_refusals_and_runs_of_every_feature() -> None:
    refused = {cell.column for cell in CELLS if cell.problem is not None}
    works = {key for cell in CELLS if cell.problem is None for key in (cell.row, cell.column)}
    assert {feature.key for feature in FEATURES} <= works
    assert {"DP", "secagg", "async", "simulated clock", "stateless"} <= refused


def test_an_explicit_guard_flag_the_run_turns_off_is_refused_not_ignored() -> None:
    settings = SimulationSettings.load(None, **TINY, dp_noise=1.0, norm_bound=2.0)
    with pytest.raises(ValueError, match="--norm-bound: DP clips every update"):
        check(settings, [parse_algorithm_config("fedavg", {})])
    # the guard's flags at their defaults, or off, are the documented resolution
    for off in ({}, {"norm_bound": 0.0, "max_count_ratio": 0.0, "max_weight_share": 1.0}):
        check(SimulationSettings.load(None, **TINY, dp_noise=1.0, **off), [])


def test_every_stage_is_checked_not_only_the_final_one() -> None:
    settings = SimulationSettings.load(None, **TINY, dp_noise=1.0, pretrain_rounds=1)
    with pytest.raises(ValueError, match="differential privacy: federico relays"):
        check(
            settings, [parse_algorithm_config("fedavg", {}), parse_algorithm_config("federico", {})]
        )


def test_the_declared_resolutions_are_what_the_run_does() -> None:
    dp = SimulationSettings.load(None, **TINY, dp_noise=1.0)
    secure = SimulationSettings.load(None, **TINY, secagg=True)
    relay = SimulationSettings.load(None, **TINY, algorithm="federico")
    assert resolutions(dp, stage_configs(dp)) == [f"guard: {FEATURE['guard'].resolutions['DP']}"]
    assert (dp.guard_settings().max_count_ratio, dp.guard_settings().norm_bound) == (0.0, 0.0)
    assert dp.guard_settings().max_weight_share == 1.0
    assert (secure.guard_settings().max_count_ratio, secure.guard_settings().norm_bound) == (0, 0)
    secure_settings = secure.secure_aggregation()
    assert secure_settings is not None
    assert secure_settings.max_weight_share == secure.guard.max_weight_share
    assert resolutions(relay, stage_configs(relay)) == [
        f"guard: {FEATURE['guard'].note(relay.algorithm_config())}"
    ]
    assert relay.guard_settings().norm_bound == 0.0
    sampled = SimulationSettings.load(None, **TINY, dp_noise=1.0, participation=0.75)
    assert any(note.startswith("participation < 1: ") for note in resolutions(sampled, []))
    task = load_task("sine", {})
    stages = plan_stages(sampled, task, task.build_model(0))
    assert stages.participation == 1.0  # the engine's Poisson draw at 0.75 is the cohort
