"""A BatchNorm CNN trains under every registered algorithm for two rounds, or is refused.

The refusal is the one coordinator/stages/features.py declares (docs/compatibility.md); the
BatchNorm column of tests/coordinator/test_compatibility.py runs the default (personal
statistics) on four devices, this runs both kinds of statistics on three.
"""

from __future__ import annotations

import math
import re

import pytest

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.stages.compatibility import problem, stage_configs
from protocols.algorithms import algorithm_names

TASK = "tests.normalization.bn_models:task"
FEWER_STEPS = ("pfedme", "pfedbred")
"""Their 20 prox iterations a round are most of the time: two suffice here."""


def _settings(algorithm: str, **values: object) -> SimulationSettings:
    """Two rounds on three devices of the BatchNorm CNN."""
    options = {"local_steps": 2} if algorithm in FEWER_STEPS else {}
    tiny = {"devices": 3, "rounds": 2, "seed": 0, "workers": 1, "algorithm_options": options}
    return SimulationSettings.load(None, task=TASK, algorithm=algorithm, **tiny, **values)


def _trains_two_rounds(settings: SimulationSettings) -> None:
    rounds: list[int] = []
    result = run_simulation(settings, on_round=lambda record: rounds.append(record.round_id))
    assert rounds == [1, 2]
    metrics = result.summary.metrics
    assert metrics is not None
    assert metrics["personalized_mean"] is not None
    assert all(math.isfinite(value) for value in metrics.values() if value is not None)


@pytest.mark.parametrize("norm_stats", ["personal", "shared"])
@pytest.mark.parametrize("algorithm", algorithm_names())
def test_a_batch_norm_model_trains_or_is_refused_with_its_reason(
    algorithm: str, norm_stats: str
) -> None:
    settings = _settings(algorithm, norm_stats=norm_stats)
    reason = problem(settings, stage_configs(settings))
    if reason is None:
        _trains_two_rounds(settings)
        return
    assert reason.startswith("a model with BatchNorm: ")
    rounds: list[int] = []
    with pytest.raises(ValueError, match=f"^{re.escape(reason)}$"):
        run_simulation(settings, on_round=lambda record: rounds.append(record.round_id))
    assert rounds == []


def test_only_model_relaying_and_sharing_nothing_are_refused() -> None:
    refused = set()
    for algorithm in algorithm_names():
        for norm_stats in ("personal", "shared"):
            settings = _settings(algorithm, norm_stats=norm_stats)
            if problem(settings, stage_configs(settings)) is not None:
                refused.add((algorithm, norm_stats))
    assert refused == {("federico", "personal"), ("federico", "shared"), ("local", "shared")}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedalt", "fedsim", "ditto"])
def test_the_fedbn_preset_trains_with_batch_norm_layers_personal(algorithm: str) -> None:
    _trains_two_rounds(_settings(algorithm, personal_preset="fedbn"))
