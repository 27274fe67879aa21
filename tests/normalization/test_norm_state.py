"""BatchNorm state: statistics personal by default (FedBN) or shared and averaged; counters stay.

`pfl_tasks.split` declares each state_dict tensor's kind; these tests check the split it gives,
and what a fleet of three devices keeps, sends and averages round after round.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.training import (
    StepBudget,
    TrainSpec,
    chunks,
    estimate_statistics,
    minibatches,
    train,
)
from pfl_tasks.base import Split
from pfl_tasks.registry import load_task
from pfl_tasks.split import resolve_split, state_kinds
from protocols.algorithms import FedAltConfig, FedAvgConfig
from protocols.errors import TrainingError
from tests.normalization.bn_fleet import DEVICES, as_float, run_fleet

TASK_NAME = "tests.normalization.bn_models:task"
TASK = load_task(TASK_NAME)
STATS = ("features.1.running_mean", "features.1.running_var")
COUNTER = "features.1.num_batches_tracked"


def test_each_tensor_is_declared_a_parameter_statistic_or_counter() -> None:
    kinds = state_kinds(TASK.build_model(0))
    assert [kinds[name] for name in (*STATS, COUNTER)] == ["statistic", "statistic", "counter"]
    assert kinds["features.1.weight"] == kinds["head.bias"] == "parameter"
    assert list(kinds) == list(TASK.build_model(0).state_dict())


def test_statistics_are_personal_by_default_shared_on_request_counters_always_stay() -> None:
    model = TASK.build_model(0)
    default = resolve_split(model, TASK.personal_patterns, FedAvgConfig())
    shared = resolve_split(model, TASK.personal_patterns, FedAvgConfig(norm_stats="shared"))
    counters = {name for name, kind in state_kinds(model).items() if kind == "counter"}
    assert len(counters) == 3
    assert set(STATS) <= set(default.personal)
    assert set(STATS) <= set(shared.shared)
    assert counters <= set(default.personal)
    assert counters <= set(shared.personal)
    assert not counters & set(default.shared + shared.shared)
    assert set(default.by_kind) == {
        *counters,
        *STATS,
        "features.5.running_mean",
        "features.5.running_var",
        "hidden.1.running_mean",
        "hidden.1.running_var",
    }
    assert set(shared.by_kind) == counters


def test_the_fedbn_preset_keeps_every_normalization_layer_whole_on_the_device() -> None:
    model = TASK.build_model(0)
    split = resolve_split(model, (), FedAltConfig(personal_preset="fedbn", norm_stats="shared"))
    layers = ("features.1.", "features.5.", "hidden.1.")
    assert {name for name in model.state_dict() if name.startswith(layers)} == set(split.personal)
    assert "features.1.weight" in split.personal  # the affine part too
    assert all(not name.startswith(layers) for name in split.shared)


def test_personal_statistics_stay_on_each_device_across_rounds_and_differ() -> None:
    fleet = run_fleet(TASK, rounds=2)
    assert all(not set(update) & {*STATS, COUNTER} for r in fleet.updates for update in r.values())
    assert not set(fleet.shared) & {*STATS, COUNTER}
    first = {device: fleet.stores[device].saved[0] for device in DEVICES}
    second = {device: fleet.stores[device].saved[1] for device in DEVICES}
    for device in DEVICES:  # round 2 went on from round 1's statistics: the counter doubled
        assert int(second[device][COUNTER]) == 2 * int(first[device][COUNTER]) > 0
        assert not torch.equal(second[device][STATS[0]], first[device][STATS[0]])
    means = [second[device][STATS[0]] for device in DEVICES]
    assert not torch.allclose(means[0], means[1])
    assert not torch.allclose(means[1], means[2])


def test_shared_statistics_are_averaged_like_parameters() -> None:
    initial = TASK.build_model(0).state_dict()
    fleet = run_fleet(
        TASK,
        rounds=1,
        norm_stats="shared",
        algorithm_options={"aggregation_weights": "uniform"},
    )
    deltas = fleet.updates[0]
    assert set(deltas) == set(DEVICES)
    for name in STATS:
        mean = sum(as_float(deltas[device][name]) for device in DEVICES) / len(DEVICES)
        expected = as_float(initial[name]) + mean
        torch.testing.assert_close(as_float(fleet.shared[name]), expected, rtol=0, atol=1e-6)
    assert all(COUNTER not in delta for delta in deltas.values())
    # the devices kept only their counters (and the task's personal head)
    kept = fleet.stores[DEVICES[0]].saved[0]
    assert COUNTER in kept
    assert not set(STATS) & set(kept)


def test_a_lone_last_sample_joins_the_batch_before_it_for_batch_norm() -> None:
    data = Split(torch.rand(9, 1, 8, 8), torch.randint(0, 10, (9,)))
    sizes = [len(x) for x, _ in minibatches(data, 4, 1, torch.Generator(), min_batch=2)]
    assert sizes == [4, 5]
    assert [len(x) for x, _ in minibatches(data, 4, 1, torch.Generator())] == [4, 4, 1]
    model = TASK.build_model(0)
    spec = TrainSpec(
        trainable=tuple(n for n, _ in model.named_parameters()), epochs=2, batch_size=4, lr=0.1
    )
    stats = train(model, TASK, data, spec, torch.Generator().manual_seed(0))
    assert stats.steps == 4
    assert stats.samples == 18


def test_micro_batches_of_a_batch_norm_model_hold_two_samples_or_more() -> None:
    assert chunks(9, 4, 2) == [(0, 4), (4, 9)]
    assert chunks(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert chunks(1, 4, 2) == [(0, 1)]
    data = Split(torch.rand(9, 1, 8, 8), torch.randint(0, 10, (9,)))
    model = TASK.build_model(0)
    spec = TrainSpec(
        trainable=tuple(n for n, _ in model.named_parameters()), epochs=1, batch_size=9, lr=0.1
    )
    for micro in (1, 4):  # micro-batches of 1 become 2; a lone last row joins the one before
        budget = StepBudget(micro_batch_size=micro)
        stats = train(model, TASK, data, spec, torch.Generator().manual_seed(0), budget=budget)
        assert stats.steps == 1


def test_one_sample_cannot_train_batch_norm_and_says_so() -> None:
    data = Split(torch.rand(1, 1, 8, 8), torch.randint(0, 10, (1,)))
    model = TASK.build_model(0)
    spec = TrainSpec(trainable=("head.bias",), epochs=1, batch_size=4, lr=0.1)
    with pytest.raises(TrainingError, match="BatchNorm cannot train on a single sample"):
        train(model, TASK, data, spec, torch.Generator())


def test_the_global_model_is_evaluated_with_each_devices_own_statistics() -> None:
    # FedAvg deploys the global model: with personal statistics, the device's copy of it holds
    # the device's own statistics, so its global and personalized scores are one model's
    settings = SimulationSettings.load(
        None, task=TASK_NAME, algorithm="fedavg", devices=3, rounds=2, seed=0, workers=1
    )
    metrics = run_simulation(settings).summary.metrics
    assert metrics is not None
    assert metrics["global"] == metrics["personalized_mean"]


def test_a_stateless_device_estimates_its_personal_statistics_from_its_own_data() -> None:
    first, second = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    model = torch.nn.Sequential(first, second).eval()
    inputs = torch.randn(40, 3) * torch.tensor([1.0, 2.0, 3.0]) + torch.tensor([5.0, 0.0, -1.0])
    data = Split(inputs, torch.zeros(40, dtype=torch.int64))
    assert estimate_statistics(model, {"0.running_mean", "0.running_var"}, data)
    torch.testing.assert_close(first.running_mean, inputs.mean(0))
    torch.testing.assert_close(first.running_var, inputs.var(0))
    assert second.running_mean is not None
    assert torch.equal(second.running_mean, torch.zeros(3))  # not named: untouched
    assert first.momentum == 0.1
    assert not any(module.training for module in model.modules())
    assert not estimate_statistics(model, {"1.weight"}, data)  # no statistic named


def test_stateless_devices_evaluate_with_statistics_of_their_own_data() -> None:
    settings = SimulationSettings.load(
        None,
        task=TASK_NAME,
        algorithm="fedavg",
        stateless=True,
        devices=3,
        rounds=2,
        seed=0,
        workers=1,
    )
    metrics = run_simulation(settings).summary.metrics
    assert metrics is not None
    accuracy = metrics["personalized_mean"]
    assert accuracy is not None
    assert accuracy > 0.5  # with the initial statistics (mean 0, variance 1) it scores 0.137
