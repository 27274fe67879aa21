"""Qualitative results on digits with the foundation issue's settings (docs/results.md)."""

import statistics

import pytest

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from tests.run_metrics import fleet_metric

# Whole simulations several times over: on a loaded machine they take many times their idle
# time, so they get a longer hang guard than the suite's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _mean_accuracy(
    algorithm: str, devices: int, seeds: tuple[int, ...], pretrain_rounds: int = 0
) -> list[float]:
    scores = []
    for seed in seeds:
        settings = SimulationSettings.load(
            None,
            task="digits",
            algorithm=algorithm,
            devices=devices,
            rounds=30 - pretrain_rounds,
            pretrain_rounds=pretrain_rounds,
            local_epochs=2,
            lr=0.1,
            alpha=0.3,
            seed=seed,
            algorithm_options={"finetune_epochs": 3, "finetune_lr": 0.02}
            if algorithm == "fedavg-ft"
            else {},
        )
        scores.append(fleet_metric(run_simulation(settings).summary))
    return scores


def test_fedavg_ft_beats_fedavg_beats_local_with_many_samples_per_device() -> None:
    # Execute: 20 devices (~60 training samples each), Dirichlet(0.3), 3 seeds
    local = _mean_accuracy("local", 20, (0, 1, 2))
    fedavg = _mean_accuracy("fedavg", 20, (0, 1, 2))
    finetuned = _mean_accuracy("fedavg-ft", 20, (0, 1, 2))
    # Assert: the ordering on the mean over seeds, and sane absolute levels
    assert statistics.mean(finetuned) > statistics.mean(fedavg) > statistics.mean(local)
    assert min(finetuned) > 0.9
    assert min(local) > 0.8


def test_federation_wins_by_a_wide_margin_with_a_dozen_samples_per_device() -> None:
    # Execute: 100 devices (~12 training samples each), one seed
    local = _mean_accuracy("local", 100, (0,))[0]
    fedavg = _mean_accuracy("fedavg", 100, (0,))[0]
    finetuned = _mean_accuracy("fedavg-ft", 100, (0,))[0]
    # Assert
    assert fedavg > local + 0.08
    assert finetuned > local + 0.1


def test_fedalt_with_warm_started_heads_beats_local_and_ties_or_beats_fedsim() -> None:
    # Execute: the spec's pipeline, 15 FedAvg rounds then 15 rounds with output-layer heads
    local = _mean_accuracy("local", 20, (0, 1, 2))
    fedalt = _mean_accuracy("fedalt", 20, (0, 1, 2), pretrain_rounds=15)
    fedsim = _mean_accuracy("fedsim", 20, (0, 1, 2), pretrain_rounds=15)
    # Assert: FedAlt clearly beats local; against FedSim it is level within one test sample per
    # device on average (0.940 against 0.941 here), the paper's FedAlt >= FedSim up to noise
    assert statistics.mean(fedalt) > statistics.mean(local) + 0.03
    assert statistics.mean(fedalt) >= statistics.mean(fedsim) - 0.005
